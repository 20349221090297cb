//! Dispatch end to end against the ComfyUI simulator (real HTTP and WebSocket): tasks become
//! images and settled points; failures, cancels and timeouts return the points; and the chaos
//! cases (a server killed and restarted, a silenced socket, the leader killed, Redis flushed).
//! The saga is driven step by step ([`Saga::step`]); nothing here sleeps.
//!
//! After every case: each task has exactly one end, every hold is settled or released exactly
//! once (balances, and `zhihui audit verify`), and no slot is leased.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use comfyui_sim::{Faults, SimConfig, Simulator};
use futures::StreamExt;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::dispatch::Saga;
use zhihui::state::AppState;
use zhihui::tasks::queue::lease::{Claimed, Fill, FillPlan, ServerSlots, Term};
use zhihui_domain::points::Points;
use zhihui_domain::task::{TaskCommand, TaskError, TaskEvent, TaskStatus};

use crate::helpers::{TestApp, spawn_app_with};
use crate::tasks::{
    account_of, flush_prefix, funded_user, metadata, project_and_verify, submit, task_events,
};

/// Longest a test drives the saga before it fails (a hang, not a slow machine).
pub(crate) const DRIVE_LIMIT: Duration = Duration::from_secs(60);

pub(crate) struct Harness {
    pub(crate) app: TestApp,
    pub(crate) sims: Vec<Simulator>,
    pub(crate) directory: TempDirectory,
}

/// A directory removed at the end of the test.
pub(crate) struct TempDirectory(pub(crate) std::path::PathBuf);

impl Drop for TempDirectory {
    fn drop(&mut self) {
        drop(std::fs::remove_dir_all(&self.0));
    }
}

/// The catalog's models: what every simulator offers unless a test says otherwise.
pub(crate) fn catalog_models() -> Vec<String> {
    vec![
        "majicmixRealistic_v7.safetensors".into(),
        "anythingelseV4_v45.safetensors".into(),
    ]
}

pub(crate) async fn start_sim(
    directory: &std::path::Path,
    index: usize,
    models: Vec<String>,
    faults: Faults,
) -> Simulator {
    Simulator::start(SimConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        output_dir: directory.join(format!("sim-{index}")),
        models,
        faults,
    })
    .await
    .unwrap()
}

/// An app with `backends` simulators of capacity 1 and short timings (so that recovery paths
/// run within a test).
pub(crate) async fn harness(backends: usize, faults: Faults) -> Harness {
    harness_with(backends, faults, |_| {}).await
}

/// [`harness`] with further dispatch settings.
pub(crate) async fn harness_with(
    backends: usize,
    faults: Faults,
    customise: impl FnOnce(&mut zhihui::platform::configuration::DispatchSettings) + Send + 'static,
) -> Harness {
    harness_configured(backends, faults, |settings| {
        customise(&mut settings.dispatch)
    })
    .await
}

/// [`harness`] with any further settings.
pub(crate) async fn harness_configured(
    backends: usize,
    faults: Faults,
    customise: impl FnOnce(&mut zhihui::platform::configuration::Settings) + Send + 'static,
) -> Harness {
    harness_of_models(vec![catalog_models(); backends], faults, customise).await
}

/// [`harness_configured`] with one simulator per entry of `models`, offering those checkpoints.
pub(crate) async fn harness_of_models(
    models: Vec<Vec<String>>,
    faults: Faults,
    customise: impl FnOnce(&mut zhihui::platform::configuration::Settings) + Send + 'static,
) -> Harness {
    let directory = std::env::temp_dir().join(format!("zhihui-dispatch-{}", Uuid::now_v7()));
    let mut sims = Vec::new();
    for (index, offered) in models.into_iter().enumerate() {
        sims.push(start_sim(&directory, index, offered, faults.clone()).await);
    }
    let specs: Vec<String> = sims
        .iter()
        .enumerate()
        .map(|(index, sim)| format!("gpu-{index} {} 1", sim.base_url()))
        .collect();
    let images = directory.join("images");
    let app = spawn_app_with(move |settings| {
        let dispatch = &mut settings.dispatch;
        // Tests lead by hand.
        dispatch.enabled = false;
        dispatch.backends = specs;
        dispatch.images_directory = images.to_string_lossy().into_owned();
        dispatch.tick_ms = 20;
        dispatch.leader_lease_ms = 1_000;
        dispatch.leader_renew_ms = 100;
        dispatch.leader_retry_ms = 50;
        dispatch.slot_lease_ms = 2_000;
        dispatch.slot_renew_ms = 200;
        dispatch.socket_ping_interval_ms = 100;
        dispatch.socket_silence_max_ms = 500;
        dispatch.reconnect_backoff_min_ms = 20;
        dispatch.reconnect_backoff_max_ms = 200;
        dispatch.reconcile_interval_ms = 300;
        dispatch.orphan_scan_interval_ms = 300;
        dispatch.history_retry_ms = 20;
        dispatch.progress_notify_interval_ms = 0;
        customise(settings);
    })
    .await;
    Harness {
        app,
        sims,
        directory: TempDirectory(directory),
    }
}

impl Harness {
    /// Services of another zhihui process on the same database and Redis (its own dispatcher).
    pub(crate) fn process(&self) -> AppState {
        self.app.services_on_app_clock()
    }

    /// Become the leader (retrying while another process still holds the lease).
    pub(crate) async fn lead(&self, process: &AppState) -> Saga {
        let started = tokio::time::Instant::now();
        loop {
            if let Some(saga) = process.dispatcher.lead().await.unwrap() {
                return saga;
            }
            assert!(started.elapsed() < DRIVE_LIMIT, "never became the leader");
            tokio::task::yield_now().await;
        }
    }
}

pub(crate) async fn status_of(process: &AppState, task_id: &str) -> zhihui_domain::task::TaskState {
    process
        .tasks
        .load(Uuid::parse_str(task_id).unwrap())
        .await
        .unwrap()
}

/// Step the saga until every task is in one of `statuses`.
pub(crate) async fn drive_until(
    saga: &mut Saga,
    process: &AppState,
    tasks: &[String],
    statuses: &[TaskStatus],
) {
    let started = tokio::time::Instant::now();
    loop {
        let mut all = true;
        for task_id in tasks {
            if !statuses.contains(&status_of(process, task_id).await.status) {
                all = false;
                break;
            }
        }
        if all {
            return;
        }
        if started.elapsed() >= DRIVE_LIMIT {
            let mut now = Vec::new();
            for task_id in tasks {
                now.push(status_of(process, task_id).await.status);
            }
            panic!("tasks did not reach {statuses:?}: they are {now:?}");
        }
        if let Err(error) = saga.step().await {
            panic!("saga step failed: {error:#}");
        }
    }
}

/// Step until the saga follows no task any more (every completion recorded and settled).
pub(crate) async fn drive_until_idle(saga: &mut Saga) {
    let started = tokio::time::Instant::now();
    while saga.in_flight() > 0 {
        assert!(started.elapsed() < DRIVE_LIMIT, "the saga never went idle");
        saga.step().await.unwrap();
    }
}

/// Step until both server sockets are open (posts need a socket's clientId).
pub(crate) async fn drive_until_connected(saga: &mut Saga, count: usize) {
    let started = tokio::time::Instant::now();
    while saga.connected_backends() < count {
        assert!(started.elapsed() < DRIVE_LIMIT, "sockets never opened");
        saga.step().await.unwrap();
    }
}

pub(crate) async fn submit_task(app: &TestApp, token: &str, images: u32, steps: u32) -> String {
    let response = submit(
        app,
        token,
        &json!({"prompt": "a red fox in the snow", "images": images, "steps": steps}),
        None,
    )
    .await;
    assert_eq!(response.status(), 201);
    let body: Value = response.json().await.unwrap();
    body["task_id"].as_str().unwrap().to_owned()
}

/// The invariants every case ends with.
pub(crate) async fn assert_settled(
    harness: &Harness,
    process: &AppState,
    user: &str,
    expected_available: i64,
) {
    let account = account_of(&harness.app, user).await;
    assert_eq!(account.balance.available, Points::whole(expected_available));
    assert_eq!(
        account.balance.frozen,
        Points::ZERO,
        "a hold was left frozen"
    );
    for name in process.dispatcher.backend_names() {
        let busy = process.dispatcher.leases().busy_slots(&name).await.unwrap();
        assert!(busy.is_empty(), "slots of {name} still leased: {busy:?}");
    }
    project_and_verify(&harness.app).await;
}

/// The reason recorded in a task's `TaskFailed`.
pub(crate) async fn failure_reason(app: &TestApp, task_id: &str) -> String {
    failure_reason_if_any(&task_events(app, task_id).await).expect("the task failed")
}

/// SIGKILL a simulator, then step the saga until it saw its socket go.
async fn crash_and_wait(saga: &mut Saga, sim: &Simulator) {
    sim.crash().await;
    let started = tokio::time::Instant::now();
    while saga.connected_backends() > 0 {
        assert!(started.elapsed() < DRIVE_LIMIT);
        saga.step().await.unwrap();
    }
}

fn ends(events: &[TaskEvent]) -> usize {
    events
        .iter()
        .filter(|event| {
            matches!(
                event,
                TaskEvent::Succeeded(_) | TaskEvent::Failed(_) | TaskEvent::Cancelled(_)
            )
        })
        .count()
}

/// The next text message on a user socket, as JSON (other frames skipped).
async fn next_text<S, E>(socket: &mut S) -> Value
where
    S: futures::Stream<Item = Result<async_tungstenite::tungstenite::Message, E>> + Unpin,
    E: std::fmt::Debug,
{
    loop {
        let frame = tokio::time::timeout(DRIVE_LIMIT, socket.next())
            .await
            .expect("no message within the limit")
            .expect("the socket closed")
            .unwrap();
        if let async_tungstenite::tungstenite::Message::Text(text) = frame {
            return serde_json::from_str(text.as_str()).unwrap();
        }
    }
}

#[tokio::test]
async fn tasks_become_images_the_points_are_settled_and_the_owner_is_told() {
    let harness = harness(2, Faults::default()).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "painter", "10").await;
    let (_, other_token) = funded_user(app, "neighbour", "10").await;
    // The owner's socket, connected before anything happens.
    let mut socket = app.socket(&token).await;
    let mut other_socket = app.socket(&other_token).await;

    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 2).await;
    let tasks = vec![
        submit_task(app, &token, 2, 3).await,
        submit_task(app, &token, 1, 3).await,
        submit_task(app, &token, 1, 3).await,
    ];
    // Nothing is dispatched until the saga is driven: the owner hears its tasks' places first.
    // (Driven at once, a task may leave the queue before the board has read it: a place told
    // after the task was dispatched is not told at all.)
    let mut heard: Vec<Value> = Vec::new();
    while !heard.iter().any(|m| m["type"] == "position") {
        heard.push(next_text(&mut socket).await);
    }
    drive_until(&mut saga, &process, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;

    // 4 images at 1 point each, deducted; nothing frozen.
    assert_settled(&harness, &process, &user, 6).await;
    let view: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{}", tasks[0]))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(view["status"], "succeeded");
    let images = view["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);
    let url = images[0]["url"].as_str().unwrap();
    assert!(url.starts_with("/api/v1/images/"), "{url}");
    let image = app.get_as(&token, url).await;
    assert_eq!(image.status(), 200);
    let headers = image.headers().clone();
    assert_eq!(headers["content-type"], "image/png");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert!(
        headers["cache-control"]
            .to_str()
            .unwrap()
            .contains("private")
    );
    let etag = headers["etag"].to_str().unwrap().to_owned();
    assert!(
        etag.starts_with('"') && !etag.starts_with("W/"),
        "strong: {etag}"
    );
    let bytes = image.bytes().await.unwrap();
    assert_eq!(&bytes[..4], b"\x89PNG");
    assert_eq!(
        headers["content-length"].to_str().unwrap(),
        bytes.len().to_string()
    );
    // Asked again with its ETag: 304, no body; another ETag: the image.
    let again = reqwest::Client::new()
        .get(format!("{}{url}", app.address))
        .bearer_auth(&token)
        .header("If-None-Match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);
    assert!(again.bytes().await.unwrap().is_empty());
    let changed = reqwest::Client::new()
        .get(format!("{}{url}", app.address))
        .bearer_auth(&token)
        .header("If-None-Match", "\"something else\"")
        .send()
        .await
        .unwrap();
    assert_eq!(changed.status(), 200);
    // Another user with the right ETag still learns nothing.
    let probing = reqwest::Client::new()
        .get(format!("{}{url}", app.address))
        .bearer_auth(&other_token)
        .header("If-None-Match", &etag)
        .send()
        .await
        .unwrap();
    assert_eq!(probing.status(), 404);
    // Nobody else sees it; no ComfyUI address anywhere in the view.
    assert_eq!(app.get_as(&other_token, url).await.status(), 404);
    assert!(!view.to_string().contains("127.0.0.1"));
    // Each task ran on a server and ended once.
    for task_id in &tasks {
        let events = task_events(app, task_id).await;
        assert_eq!(ends(&events), 1);
        assert!(events.iter().any(|e| matches!(e, TaskEvent::Started(_))));
    }

    // The owner heard progress and the results; the other user heard nothing of them.
    while heard
        .iter()
        .filter(|message| message["type"] == "succeeded")
        .count()
        < tasks.len()
    {
        heard.push(next_text(&mut socket).await);
    }
    assert!(
        heard
            .iter()
            .any(|m| m["type"] == "progress" && m["max"] == 3.0)
    );
    let succeeded = heard
        .iter()
        .find(|m| m["type"] == "succeeded" && m["task_id"] == tasks[0].as_str())
        .unwrap();
    assert_eq!(succeeded["images"].as_array().unwrap().len(), 2);
    // Frames without a task are the owner's own credit, told late: the hub may forward the grant's
    // notice after this socket joined.
    for message in heard.iter().filter(|m| m["type"] != "points_credited") {
        assert!(tasks.contains(&message["task_id"].as_str().unwrap().to_owned()));
    }
    // The other user's socket is still open and has heard nothing: its next task frame is the
    // answer to its own submit, not anything about the painter's tasks.
    let theirs = submit_task(app, &other_token, 1, 1).await;
    loop {
        let frame = tokio::time::timeout(DRIVE_LIMIT, other_socket.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let async_tungstenite::tungstenite::Message::Text(text) = frame {
            let message: Value = serde_json::from_str(text.as_str()).unwrap();
            if message["type"] == "points_credited" {
                // Their own grant, told late (see above).
                assert_eq!(message["amount"], "10.00", "{message}");
                continue;
            }
            assert_eq!(
                message["task_id"],
                theirs.as_str(),
                "heard another user's task"
            );
            break;
        }
    }
    saga.resign().await;
}

#[tokio::test]
async fn a_runtime_error_or_a_rejected_workflow_fails_the_task_and_returns_its_points() {
    let faults = Faults {
        fail_node_class: Some("KSampler".into()),
        ..Faults::default()
    };
    let harness = harness(1, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "unlucky", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 2, 2).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let reason = failure_reason(app, &task).await;
    assert!(reason.contains("KSampler"), "{reason}");
    assert!(!reason.contains("Traceback"), "{reason}");
    assert_settled(&harness, &process, &user, 10).await;
    saga.resign().await;
}

#[tokio::test]
async fn a_server_naming_more_or_foreign_outputs_fails_the_task_and_nothing_is_downloaded() {
    let faults = Faults {
        hostile_outputs: true,
        ..Faults::default()
    };
    let harness = harness(1, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "wary", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 1, 2).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let reason = failure_reason(app, &task).await;
    assert!(
        reason.contains("images where 1 were asked for") || reason.contains("outside"),
        "{reason}"
    );
    assert!(!reason.contains("etc"), "{reason}");
    // Nothing of the task was stored; its points came back.
    let view: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{task}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(view["images"].as_array().map_or(0, Vec::len), 0, "{view}");
    assert_settled(&harness, &process, &user, 10).await;
    saga.resign().await;
}

/// Whether the server's own history shows the prompt of `task_id` (the one its dispatch
/// recorded) ended by an interrupt (ComfyUI's `execution_interrupted` status message).
async fn interrupted_on_the_server(sim: &Simulator, app: &TestApp, task_id: &str) -> bool {
    let prompt_id = task_events(app, task_id)
        .await
        .into_iter()
        .find_map(|event| match event {
            TaskEvent::Dispatched(dispatched) => Some(dispatched.prompt_id),
            _ => None,
        })
        .expect("the task was dispatched");
    let history: Value = reqwest::get(format!("{}/history/{prompt_id}", sim.base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    history[prompt_id.to_string()]["status"]["messages"]
        .as_array()
        .is_some_and(|messages| {
            messages
                .iter()
                .any(|message| message[0] == "execution_interrupted")
        })
}

#[tokio::test]
async fn cancelling_a_running_task_interrupts_it_and_returns_its_points() {
    let faults = Faults {
        step_delay_ms: 50,
        ..Faults::default()
    };
    let harness = harness(1, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "changed-mind", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    // 40 steps of 50 ms: long enough to be cancelled while running.
    let running = submit_task(app, &token, 1, 40).await;
    let waiting = submit_task(app, &token, 1, 1).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&running),
        &[TaskStatus::Running],
    )
    .await;
    let cancel = crate::tasks::act(app, &token, "cancel", &running).await;
    assert_eq!(cancel.status(), 202);
    drive_until(
        &mut saga,
        &process,
        &[running.clone(), waiting.clone()],
        &[TaskStatus::Cancelled, TaskStatus::Succeeded],
    )
    .await;
    drive_until_idle(&mut saga).await;
    assert_eq!(
        status_of(&process, &running).await.status,
        TaskStatus::Cancelled
    );
    // The freed slot went to the waiting task.
    assert_eq!(
        status_of(&process, &waiting).await.status,
        TaskStatus::Succeeded
    );
    // And the server was told: its history shows the prompt interrupted (the saga would record
    // the same outcome after giving up on an interrupt that never arrived).
    assert!(interrupted_on_the_server(&harness.sims[0], &harness.app, &running).await);
    assert!(!interrupted_on_the_server(&harness.sims[0], &harness.app, &waiting).await);
    assert_settled(&harness, &process, &user, 9).await;
    saga.resign().await;
}

#[tokio::test]
async fn a_task_past_its_timeout_is_interrupted_and_fails() {
    let faults = Faults {
        step_delay_ms: 200,
        ..Faults::default()
    };
    let harness = harness_with(1, faults, |dispatch| dispatch.task_timeout_ms = 1_000).await;
    let (user, token) = funded_user(&harness.app, "patient", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    // 50 steps of 200 ms: 10 s, far past the 1 s limit.
    let task = submit_task(&harness.app, &token, 1, 50).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let reason = failure_reason(&harness.app, &task).await;
    assert!(reason.contains("longer than the limit of 1 s"), "{reason}");
    // The server stopped running it: its history shows the prompt interrupted (without the
    // interrupt it would still be running there, for 9 more seconds).
    assert!(interrupted_on_the_server(&harness.sims[0], &harness.app, &task).await);
    assert_settled(&harness, &process, &user, 10).await;
    saga.resign().await;
}

#[tokio::test]
async fn a_server_killed_mid_task_and_restarted_loses_nothing() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness(1, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "crash-survivor", "10").await;
    let mut socket = app.socket(&token).await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let tasks = vec![
        submit_task(app, &token, 1, 20).await,
        submit_task(app, &token, 1, 2).await,
    ];
    drive_until(&mut saga, &process, &tasks[..1], &[TaskStatus::Running]).await;
    // SIGKILL: queue, history and sockets gone, connections refused.
    crash_and_wait(&mut saga, &harness.sims[0]).await;
    // The owner is told the running task (and the one staged behind it there) waits for its
    // server, not left reading its last progress.
    let mut lost = std::collections::HashSet::new();
    while !lost.contains(&tasks[0]) {
        let notice = next_text(&mut socket).await;
        if notice["type"] == "server_lost" {
            let task = notice["task_id"].as_str().unwrap().to_owned();
            assert!(tasks.contains(&task), "{notice}");
            lost.insert(task);
            continue;
        }
        assert!(
            !["succeeded", "failed", "cancelled"].contains(&notice["type"].as_str().unwrap_or("")),
            "{notice}"
        );
    }
    harness.sims[0].restart().await;
    // After the reconnect the lost prompt is found missing and posted once more, same id.
    drive_until(
        &mut saga,
        &process,
        &tasks,
        &[TaskStatus::Succeeded, TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let mut spent = 0;
    for task_id in &tasks {
        let events = task_events(app, task_id).await;
        assert_eq!(ends(&events), 1, "{events:?}");
        if events.iter().any(|e| matches!(e, TaskEvent::Succeeded(_))) {
            spent += 1;
        }
    }
    assert_eq!(spent, 2, "the lost prompt was resubmitted and finished");
    assert_settled(&harness, &process, &user, 10 - spent).await;
    saga.resign().await;
}

/// The order a real ComfyUI shows when it comes back after a SIGKILL: its HTTP answers before its
/// WebSocket does. The saga finds the running prompt unknown over HTTP while it cannot post
/// (posts need the socket's clientId); the task must wait for the socket, be posted again then,
/// and succeed, charged once: the one resubmission is spent only by a post the server accepted.
#[tokio::test]
async fn a_server_whose_http_answers_before_its_socket_after_a_restart_loses_no_task() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness(1, faults.clone()).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "restart-order", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 1, 20).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Running],
    )
    .await;
    let sim = &harness.sims[0];
    crash_and_wait(&mut saga, sim).await;
    // Back, HTTP only: the socket is refused until we say.
    sim.set_faults(Faults {
        refuse_sockets: true,
        ..faults.clone()
    });
    sim.restart().await;
    let posted_before = sim.prompts_received();
    // Two lookups of the lost prompt answered "unknown" over HTTP: the first one's answer was
    // handled (a task has one lookup out at a time) while no post could be made.
    let lookups = sim.history_lookups();
    let started = tokio::time::Instant::now();
    while sim.history_lookups() < lookups + 2 {
        assert!(
            started.elapsed() < DRIVE_LIMIT,
            "the saga never looked the prompt up"
        );
        saga.step().await.unwrap();
    }
    assert_eq!(saga.connected_backends(), 0);
    assert_eq!(status_of(&process, &task).await.status, TaskStatus::Running);
    // The socket comes back: the prompt is posted again and runs to its end.
    sim.set_faults(faults);
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Succeeded, TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let events = task_events(app, &task).await;
    assert_eq!(ends(&events), 1, "{events:?}");
    assert!(
        events.iter().any(|e| matches!(e, TaskEvent::Succeeded(_))),
        "the task was lost: {:?}",
        failure_reason_if_any(&events)
    );
    assert_eq!(
        sim.prompts_received() - posted_before,
        1,
        "posted again once"
    );
    assert_settled(&harness, &process, &user, 9).await;
    saga.resign().await;
}

/// The one resubmission, once accepted, is spent: a server that loses the same prompt again
/// fails the task (its points return) instead of posting it forever.
#[tokio::test]
async fn a_prompt_lost_again_after_its_accepted_resubmission_fails_and_returns_its_points() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness(1, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "lost-twice", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 1, 20).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Running],
    )
    .await;
    let sim = &harness.sims[0];
    for _loss in 0..2 {
        let posted_before = sim.prompts_received();
        crash_and_wait(&mut saga, sim).await;
        sim.restart().await;
        if status_of(&process, &task).await.status != TaskStatus::Running {
            break;
        }
        // Until the server accepted the prompt again (the first loss), or the task ended.
        let started = tokio::time::Instant::now();
        while sim.prompts_received() == posted_before
            && status_of(&process, &task).await.status == TaskStatus::Running
        {
            assert!(started.elapsed() < DRIVE_LIMIT, "never posted again");
            saga.step().await.unwrap();
        }
    }
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    assert_eq!(
        failure_reason(app, &task).await,
        "the image server lost the task (it restarted or dropped it)"
    );
    assert_settled(&harness, &process, &user, 10).await;
    saga.resign().await;
}

fn failure_reason_if_any(events: &[TaskEvent]) -> Option<String> {
    events.iter().find_map(|event| match event {
        TaskEvent::Failed(failed) => Some(failed.reason.clone()),
        _ => None,
    })
}

#[tokio::test]
async fn a_silenced_socket_does_not_hang_a_task() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness(1, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "in-the-dark", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 1, 10).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Running],
    )
    .await;
    // Open, but nothing arrives any more: not the end of the task, not even pongs.
    harness.sims[0].set_faults(Faults {
        step_delay_ms: 20,
        silent: true,
        ..Faults::default()
    });
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Succeeded],
    )
    .await;
    drive_until_idle(&mut saga).await;
    assert_settled(&harness, &process, &user, 9).await;
    saga.resign().await;
}

#[tokio::test]
async fn when_the_leader_dies_another_process_takes_over_and_the_old_one_is_fenced_out() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness(2, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "handed-over", "10").await;
    let first = harness.process();
    let second = harness.process();
    let mut leader = harness.lead(&first).await;
    assert!(
        second.dispatcher.lead().await.unwrap().is_none(),
        "two leaders"
    );
    drive_until_connected(&mut leader, 2).await;
    // The first two run 50 steps of 20 ms: still running when the leader is killed (their
    // `TaskStarted` is recorded off the saga's path, so seeing both running can take a while).
    let tasks = vec![
        submit_task(app, &token, 1, 50).await,
        submit_task(app, &token, 1, 50).await,
        submit_task(app, &token, 1, 2).await,
    ];
    drive_until(&mut leader, &first, &tasks[..2], &[TaskStatus::Running]).await;
    let old_token = leader.fencing_token();
    // (Projected first: the takeover's clock measures the lease, not the projections.)
    app.project().await;
    // Killed: no resignation, its lease runs out.
    drop(leader);
    let killed_at = tokio::time::Instant::now();
    let mut successor = harness.lead(&second).await;
    let takeover = killed_at.elapsed();
    assert!(
        takeover < Duration::from_secs(5),
        "takeover took {takeover:?}"
    );
    assert!(successor.fencing_token() > old_token);
    drive_until(&mut successor, &second, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut successor).await;
    for task_id in &tasks {
        let events = task_events(app, task_id).await;
        assert_eq!(ends(&events), 1);
        let dispatches = events
            .iter()
            .filter(|e| matches!(e, TaskEvent::Dispatched(_)))
            .count();
        assert_eq!(dispatches, 1, "dispatched twice: {events:?}");
    }
    // The old leader's token is refused on a task the new one adopted.
    let mut adopted = None;
    for task_id in &tasks[..2] {
        if task_events(app, task_id)
            .await
            .iter()
            .any(|e| matches!(e, TaskEvent::Adopted(_)))
        {
            adopted = Some(task_id);
        }
    }
    let adopted = adopted.expect("the new leader adopted a task that was running at the kill");
    let stale = TaskCommand::Fail {
        reason: "late".into(),
        fencing_token: old_token,
        at: app.clock.now(),
    };
    let refused = zhihui::platform::command::execute::<zhihui_domain::task::Task>(
        &second.event_store,
        &zhihui_domain::task::task_stream(Uuid::parse_str(adopted).unwrap()),
        &stale,
        &metadata(),
        zhihui::platform::command::RetryPolicy::default(),
    )
    .await;
    assert!(matches!(
        refused,
        Err(zhihui::platform::command::CommandError::Rejected(
            TaskError::StaleDispatcher { .. } | TaskError::InvalidTransition { .. }
        ))
    ));
    assert_settled(&harness, &second, &user, 7).await;
    successor.resign().await;
}

#[tokio::test]
async fn redis_flushed_mid_run_loses_no_task_and_no_point() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness(2, faults).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "flushed", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 2).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        tasks.push(submit_task(app, &token, 1, 10).await);
    }
    drive_until(&mut saga, &process, &tasks[..1], &[TaskStatus::Running]).await;
    app.project().await;
    flush_prefix(app).await;
    // The lease is gone: the saga notices at its next renewal and stops.
    let started = tokio::time::Instant::now();
    loop {
        assert!(started.elapsed() < DRIVE_LIMIT, "the saga never noticed");
        match saga.step().await {
            Ok(()) => {}
            Err(error) if error.is::<zhihui::dispatch::LostLeadership>() => break,
            Err(error) => panic!("{error:#}"),
        }
    }
    drop(saga);
    // Leading again rebuilds the queue from the events and adopts what is in flight.
    let mut saga = harness.lead(&process).await;
    drive_until(&mut saga, &process, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;
    for task_id in &tasks {
        assert_eq!(ends(&task_events(app, task_id).await), 1);
    }
    assert_settled(&harness, &process, &user, 6).await;
    saga.resign().await;
}

#[tokio::test]
async fn a_task_staged_behind_a_running_one_is_cancelled_without_ever_being_posted() {
    let faults = Faults {
        step_delay_ms: 50,
        ..Faults::default()
    };
    // Staged here, not posted ahead into the server's queue.
    let harness = harness_with(1, faults, |dispatch| dispatch.posted_ahead_per_backend = 0).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "second-thoughts", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let running = submit_task(app, &token, 1, 40).await;
    let staged = submit_task(app, &token, 1, 1).await;
    // The second is recorded as dispatched (staged for the busy server) but not posted.
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&running),
        &[TaskStatus::Running],
    )
    .await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&staged),
        &[TaskStatus::Dispatched],
    )
    .await;
    for task in [&staged, &running] {
        assert_eq!(
            crate::tasks::act(app, &token, "cancel", task)
                .await
                .status(),
            202
        );
    }
    drive_until(
        &mut saga,
        &process,
        &[running.clone(), staged.clone()],
        &[TaskStatus::Cancelled],
    )
    .await;
    drive_until_idle(&mut saga).await;
    assert_eq!(
        harness.sims[0].prompts_received(),
        1,
        "the staged task was posted"
    );
    assert_settled(&harness, &process, &user, 10).await;
    saga.resign().await;
}

#[tokio::test]
async fn staged_tasks_wait_ahead_of_the_queue_and_reach_their_server_in_queue_order() {
    let faults = Faults {
        step_delay_ms: 100,
        ..Faults::default()
    };
    let harness = harness_with(1, faults, |dispatch| dispatch.staged_per_backend = 3).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "patient", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    // 50 steps of 100 ms: still running while the others are staged and checked (with room for
    // a slow machine: the checks hold only while it runs).
    let first = submit_task(app, &token, 1, 50).await;
    let mut tasks = vec![first.clone()];
    for _ in 0..4 {
        tasks.push(submit_task(app, &token, 1, 1).await);
    }
    // While the first runs, three are recorded as dispatched to the busy server (the first of
    // them posted into its queue, still not started); the fifth waits in our queue (the staging
    // depth bounds how many are committed to one server).
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&first),
        &[TaskStatus::Running],
    )
    .await;
    drive_until(&mut saga, &process, &tasks[1..4], &[TaskStatus::Dispatched]).await;
    assert_eq!(
        status_of(&process, &tasks[4]).await.status,
        TaskStatus::Queued
    );
    drive_until(&mut saga, &process, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;
    // The server ran them in the order they were queued: by each prompt's `execution_start`
    // time in the server's history (prompts run at least one 100 ms step apart).
    let history: Value = reqwest::get(format!("{}/history", harness.sims[0].base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut ran = Vec::new();
    for task in &tasks {
        let prompt_id = status_of(&process, task).await.prompt_id.unwrap();
        let started_ms = history[prompt_id.to_string()]["status"]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|message| message[0] == "execution_start")
            .and_then(|message| message[1]["timestamp"].as_u64())
            .unwrap();
        ran.push((started_ms, task.clone()));
    }
    ran.sort();
    let ran: Vec<String> = ran.into_iter().map(|(_, task)| task).collect();
    assert_eq!(ran, tasks, "staged tasks were posted out of queue order");
    assert_settled(&harness, &process, &user, 5).await;
    saga.resign().await;
}

/// The ids in a server's `/queue`: running, pending.
async fn server_queue(sim: &Simulator) -> (Vec<String>, Vec<String>) {
    let queue: Value = reqwest::get(format!("{}/queue", sim.base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids = |key: &str| -> Vec<String> {
        queue[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item[1].as_str().unwrap().to_owned())
            .collect()
    };
    (ids("queue_running"), ids("queue_pending"))
}

#[tokio::test]
async fn a_task_posted_ahead_waits_in_the_servers_queue_and_a_cancel_deletes_it_from_there() {
    let faults = Faults {
        step_delay_ms: 100,
        ..Faults::default()
    };
    // The defaults: two staged per server, one of them posted ahead.
    let harness = harness_with(1, faults, |dispatch| {
        dispatch.staged_per_backend = 2;
        dispatch.posted_ahead_per_backend = 1;
    })
    .await;
    let sim = &harness.sims[0];
    let app = &harness.app;
    let (user, token) = funded_user(app, "early-bird", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    // 50 steps of 100 ms: running while the others are posted, staged and cancelled (with
    // room for a slow machine: the checks below hold only while it runs).
    let running = submit_task(app, &token, 1, 50).await;
    let ahead = submit_task(app, &token, 1, 1).await;
    let staged = submit_task(app, &token, 1, 1).await;
    let prompt_of = |task: &str| {
        let task = task.to_owned();
        let process = &process;
        async move {
            status_of(process, &task)
                .await
                .prompt_id
                .unwrap()
                .to_string()
        }
    };
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&running),
        &[TaskStatus::Running],
    )
    .await;
    drive_until(
        &mut saga,
        &process,
        &[ahead.clone(), staged.clone()],
        &[TaskStatus::Dispatched],
    )
    .await;
    // The second waits in the server's own queue; the third is staged here.
    let expected = (
        vec![prompt_of(&running).await],
        vec![prompt_of(&ahead).await],
    );
    let started = tokio::time::Instant::now();
    while server_queue(sim).await != expected {
        assert!(started.elapsed() < DRIVE_LIMIT, "nothing was posted ahead");
        saga.step().await.unwrap();
    }
    assert_eq!(sim.prompts_received(), 2);
    // Waiting on the server is not running: no `TaskStarted` until it starts.
    assert_eq!(
        status_of(&process, &ahead).await.status,
        TaskStatus::Dispatched
    );

    assert_eq!(
        crate::tasks::act(app, &token, "cancel", &ahead)
            .await
            .status(),
        202
    );
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&ahead),
        &[TaskStatus::Cancelled],
    )
    .await;
    // Deleted from the server's queue, the running prompt untouched; the staged task took the
    // place in the server's queue.
    let started = tokio::time::Instant::now();
    while sim.prompts_received() < 3 {
        assert!(
            started.elapsed() < DRIVE_LIMIT,
            "the staged task was not posted ahead"
        );
        saga.step().await.unwrap();
    }
    let (server_running, pending) = server_queue(sim).await;
    assert_eq!(server_running, vec![prompt_of(&running).await]);
    assert_eq!(pending, vec![prompt_of(&staged).await]);

    drive_until(
        &mut saga,
        &process,
        &[running.clone(), staged.clone()],
        &[TaskStatus::Succeeded],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let history: Value = reqwest::get(format!("{}/history", sim.base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        history.get(prompt_of(&ahead).await).is_none(),
        "the cancelled prompt ran"
    );
    let message_at = |prompt: &str, kind: &str| -> u64 {
        history[prompt]["status"]["messages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|message| message[0] == kind)
            .and_then(|message| message[1]["timestamp"].as_u64())
            .unwrap()
    };
    // The server went on to the staged prompt by itself, after the first one's end.
    assert!(
        message_at(&prompt_of(&staged).await, "execution_start")
            >= message_at(&prompt_of(&running).await, "execution_success")
    );
    for task in [&running, &staged] {
        let events = task_events(app, task).await;
        assert_eq!(ends(&events), 1);
        assert!(events.iter().any(|e| matches!(e, TaskEvent::Started(_))));
    }
    assert!(
        !task_events(app, &ahead)
            .await
            .iter()
            .any(|e| matches!(e, TaskEvent::Started(_))),
        "a task cancelled in the server's queue never started"
    );
    // Two images deducted, the cancelled hold returned.
    assert_settled(&harness, &process, &user, 8).await;
    saga.resign().await;
}

/// Ten tasks, two servers: every card of the history page says what is true of its task, checked
/// against the task's own state and the queue: running on its server, sent to its server and
/// waiting there (posted ahead, or staged for it), or its place in the queue, each place once.
/// The admin's servers page counts running and waiting apart.
#[tokio::test]
async fn every_card_says_where_its_task_is_running_waiting_on_a_server_or_its_place() {
    let faults = Faults {
        step_delay_ms: 400,
        ..Faults::default()
    };
    let harness = harness_with(2, faults, |dispatch| {
        dispatch.staged_per_backend = 2;
        dispatch.posted_ahead_per_backend = 1;
    })
    .await;
    let app = &harness.app;
    let (_, token) = funded_user(app, "xiaolan", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 2).await;
    // 50 steps of 400 ms: the first two run for 20 s, time for every check below.
    let mut tasks = Vec::new();
    for _ in 0..10 {
        tasks.push(submit_task(app, &token, 1, 50).await);
    }
    // Two run, two wait in the servers' own queues, two are staged for them, four are queued.
    let started = tokio::time::Instant::now();
    loop {
        let mut running = 0;
        let mut dispatched = 0;
        for task in &tasks {
            match status_of(&process, task).await.status {
                TaskStatus::Running => running += 1,
                TaskStatus::Dispatched => dispatched += 1,
                _ => {}
            }
        }
        if (running, dispatched) == (2, 4) {
            break;
        }
        assert!(
            started.elapsed() < DRIVE_LIMIT,
            "never two running and four sent ahead: {running} running, {dispatched} dispatched"
        );
        saga.step().await.unwrap();
    }
    app.project().await;
    let names = process.dispatcher.backend_names();
    let page = |path: &str| {
        let token = token.clone();
        let url = format!("{}{path}", app.address);
        async move {
            reqwest::Client::new()
                .get(url)
                .header("Cookie", format!("lang=zh; zhihui_session={token}"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    let history = page("/history").await;
    let mut places = Vec::new();
    for task in &tasks {
        let start = history
            .find(&format!(r#"data-task-id="{task}""#))
            .unwrap_or_else(|| panic!("no card for {task}"));
        let card = &history[start..];
        let card = &card[..card.find("</article>").unwrap()];
        let state = status_of(&process, task).await;
        let says = |text: &str| card.contains(text);
        match state.status {
            TaskStatus::Running | TaskStatus::Dispatched => {
                let backend = state
                    .backend
                    .clone()
                    .expect("a server for a task sent to one");
                assert!(names.contains(&backend));
                let expected = if state.status == TaskStatus::Running {
                    format!("正在服务器 {backend} 上生成。")
                } else {
                    format!("已交给服务器 {backend}，在那里等候")
                };
                assert!(says(&expected), "{task} ({:?}): {card}", state.status);
                assert!(
                    says(r#"<p data-field="position" hidden></p>"#),
                    "{task} is not in the queue: {card}"
                );
                if state.status == TaskStatus::Dispatched {
                    // Waiting is not running: no progress bar at 0 %.
                    assert!(
                        says(r#"hidden data-field="progress-row""#),
                        "{task} shows progress while waiting: {card}"
                    );
                }
            }
            TaskStatus::Queued => {
                let rank = process
                    .tasks
                    .queue
                    .rank(Uuid::parse_str(task).unwrap())
                    .await
                    .unwrap()
                    .expect("a queued task has a place");
                assert!(
                    says(&format!("排队第 {} 位", rank + 1)),
                    "{task} is at place {}: {card}",
                    rank + 1
                );
                assert!(!says(r#"<p data-field="server">"#), "{card}");
                places.push(rank + 1);
            }
            other => panic!("{task} is {other:?}"),
        }
    }
    places.sort_unstable();
    assert_eq!(places, vec![1, 2, 3, 4], "each place once");

    let admin = app.admin_token("guanliyuan").await;
    let servers = reqwest::Client::new()
        .get(format!("{}/admin/servers", app.address))
        .header("Cookie", format!("lang=zh; zhihui_session={admin}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in &names {
        let start = servers.find(&format!(r#"id="server-{name}""#)).unwrap();
        let row = &servers[start..];
        let row = &row[..row.find("</tr>").unwrap()];
        assert!(
            row.contains("运行中 1（容量 1）· 在此等待 2"),
            "{name}: {row}"
        );
    }
    saga.resign().await;
}

/// One fill at the depth and slot lease the fill test uses.
async fn fill(
    process: &AppState,
    term: &Term,
    releases: &[(usize, Uuid)],
    servers: &[Option<ServerSlots>],
) -> Fill {
    fill_with(process, term, releases, servers, true).await
}

async fn fill_with(
    process: &AppState,
    term: &Term,
    releases: &[(usize, Uuid)],
    servers: &[Option<ServerSlots>],
    prefer_same_model: bool,
) -> Fill {
    let names = process.dispatcher.backend_names();
    process
        .dispatcher
        .leases()
        .fill(
            term,
            &FillPlan {
                names: &names,
                releases,
                servers,
                depth: 2,
                slot_lease_ms: 10_000,
                scan_max: 256,
                prefer_same_model,
                affinity_window: 16,
                affinity_wait_max_ms: 60_000,
            },
        )
        .await
        .unwrap()
}

/// The filler's one Redis step (`dispatch_fill.lua`): releases first, then free slots on every
/// server before anything is staged, then one staged task per server per round up to the
/// depth, in queue order; servers without a socket get nothing; the live leases are a floor
/// under what the caller knows; a stale leader claims nothing but its releases still happen.
#[tokio::test]
async fn one_fill_releases_then_fills_every_free_slot_before_staging_in_queue_order() {
    let harness = harness(2, Faults::default()).await;
    let process = harness.process();
    let leases = process.dispatcher.leases();
    let names = process.dispatcher.backend_names();
    let term = leases
        .acquire("fill-test", 10_000)
        .await
        .unwrap()
        .expect("nobody else leads");
    let queued: Vec<Uuid> = (0..8).map(|_| Uuid::now_v7()).collect();
    for (score, task_id) in (1..).zip(&queued) {
        process
            .tasks
            .queue
            .enqueue(*task_id, score, None)
            .await
            .unwrap();
    }
    let slots = |busy, staged| {
        Some(ServerSlots {
            capacity: 1,
            busy,
            staged,
            last_model: None,
            models: None,
        })
    };
    let claimed = |pairs: &[(usize, usize)]| {
        pairs
            .iter()
            .map(|&(backend, index)| Claimed {
                backend,
                task_id: queued[index],
                score: i64::try_from(index).unwrap() + 1,
            })
            .collect::<Vec<_>>()
    };
    let busy = |backend: usize| {
        let leases = leases.clone();
        let name = names[backend].clone();
        async move {
            let mut busy = leases.busy_slots(&name).await.unwrap();
            busy.sort();
            busy
        }
    };

    // Both servers idle, depth 2: a slot on each, then staged 0, 1, 0, 1.
    let filled = fill(&process, &term, &[], &[slots(0, 0), slots(0, 0)]).await;
    assert_eq!(
        filled,
        Fill::Claimed {
            claims: claimed(&[(0, 0), (1, 1), (0, 2), (1, 3), (0, 4), (1, 5)]),
            queue_empty: false,
        }
    );
    assert_eq!(busy(0).await, vec![queued[0], queued[2], queued[4]]);
    assert_eq!(busy(1).await, vec![queued[1], queued[3], queued[5]]);

    // Full everywhere: nothing more, even when the caller forgot what it staged (the leases
    // are the floor).
    let filled = fill(&process, &term, &[], &[slots(1, 0), slots(0, 0)]).await;
    assert_eq!(
        filled,
        Fill::Claimed {
            claims: Vec::new(),
            queue_empty: false,
        }
    );

    // gpu-0's prompt ends (its first staged task is posted): released, then one staged task
    // tops gpu-0 up; gpu-1 has no socket and gets nothing.
    let filled = fill(&process, &term, &[(0, queued[0])], &[slots(1, 1), None]).await;
    assert_eq!(
        filled,
        Fill::Claimed {
            claims: claimed(&[(0, 6)]),
            queue_empty: false,
        }
    );
    assert_eq!(busy(0).await, vec![queued[2], queued[4], queued[6]]);

    // A leader that lost its lease claims nothing; its releases are still made.
    let stale = Term {
        instance: term.instance.clone(),
        fencing_token: term.fencing_token + 1,
        redis_replication_id: term.redis_replication_id.clone(),
    };
    let filled = fill(
        &process,
        &stale,
        &[(1, queued[1])],
        &[slots(0, 0), slots(0, 0)],
    )
    .await;
    assert_eq!(filled, Fill::NotLeader);
    assert_eq!(busy(1).await, vec![queued[3], queued[5]]);
    assert_eq!(process.tasks.queue.len().await.unwrap(), 1);

    // gpu-1 emptied: its free slot takes the last task, and the queue runs dry.
    let filled = fill(
        &process,
        &term,
        &[(1, queued[3]), (1, queued[5])],
        &[None, slots(0, 0)],
    )
    .await;
    assert_eq!(
        filled,
        Fill::Claimed {
            claims: claimed(&[(1, 7)]),
            queue_empty: true,
        }
    );
    assert_eq!(busy(1).await, vec![queued[7]]);
    leases.resign(&term).await.unwrap();
}

/// The filler routes by model: a task goes only to a server that offers its model (passed over,
/// it keeps its place in the queue), to the server that ran its model last when several could
/// take it (unless the preference is off), and a task whose model is unknown goes anywhere.
#[tokio::test]
async fn one_fill_sends_each_task_to_a_server_offering_its_model_preferring_the_last_one() {
    let harness = harness(2, Faults::default()).await;
    let process = harness.process();
    let leases = process.dispatcher.leases();
    let term = leases
        .acquire("route-test", 10_000)
        .await
        .unwrap()
        .expect("nobody else leads");
    let queue = &process.tasks.queue;
    let server = |offers: &[&str], last: Option<&str>| {
        Some(ServerSlots {
            capacity: 1,
            busy: 0,
            staged: 0,
            last_model: last.map(str::to_owned),
            models: Some(offers.iter().map(|model| (*model).to_owned()).collect()),
        })
    };
    let enqueue = |models: Vec<Option<&'static str>>| async move {
        let mut ids = Vec::new();
        for (score, model) in (1..).zip(models) {
            let task_id = Uuid::now_v7();
            queue
                .enqueue(task_id, score, model.map(|model| (model, 1)))
                .await
                .unwrap();
            ids.push(task_id);
        }
        ids
    };
    let claims_of = |filled: Fill| match filled {
        Fill::Claimed { claims, .. } => claims
            .into_iter()
            .map(|claim| (claim.backend, claim.task_id))
            .collect::<Vec<_>>(),
        Fill::NotLeader => panic!("the test leads"),
    };
    let release_all = |claims: Vec<(usize, Uuid)>| claims;

    // gpu-0 offers a, gpu-1 offers a and b. b1 can only go to gpu-1; a1 takes gpu-0's slot; a2
    // is staged behind a1 on gpu-0 (it ran a last); b2 behind b1 on gpu-1; c1 (no server offers
    // c) stays queued, in its place.
    let tasks = enqueue(vec![Some("b"), Some("a"), Some("a"), Some("c"), Some("b")]).await;
    let (b1, a1, a2, c1, b2) = (tasks[0], tasks[1], tasks[2], tasks[3], tasks[4]);
    let servers = [server(&["a"], None), server(&["a", "b"], Some("a"))];
    let claims = claims_of(fill(&process, &term, &[], &servers).await);
    assert_eq!(claims, vec![(1, b1), (0, a1), (0, a2), (1, b2)]);
    assert_eq!(queue.entries().await.unwrap(), vec![(c1, 4)]);
    let releases = release_all(claims);
    queue.remove(c1).await.unwrap();

    // Both offer a and b; gpu-0 ran b last, gpu-1 ran a: with the preference each task goes to
    // the server that ran its model, without it to the first server with room.
    for prefer in [true, false] {
        let tasks = enqueue(vec![Some("a"), Some("b")]).await;
        let servers = [
            server(&["a", "b"], Some("b")),
            server(&["a", "b"], Some("a")),
        ];
        let filled = fill_with(&process, &term, &releases, &servers, prefer).await;
        let claims = claims_of(filled);
        let expected = if prefer {
            vec![(1, tasks[0]), (0, tasks[1])]
        } else {
            vec![(0, tasks[0]), (1, tasks[1])]
        };
        assert_eq!(claims[..2], expected[..], "prefer the last model: {prefer}");
        let releases: Vec<(usize, Uuid)> = claims;
        fill(&process, &term, &releases, &[None, None]).await;
    }

    // The look-ahead: gpu-0 ran b last and is the only server with room; the queue holds a1
    // then b1: it takes b1 first, passing over a1, which has not waited its bound (60 s); a1
    // queued 10 s ago with a bound of 5 s is not passed over. (Scores say when a task was
    // queued; the script reads Redis time, so these are made from the real time.)
    let real_now_ms = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    let score_at = |ms_ago: i64| {
        (real_now_ms - ms_ago - zhihui::tasks::queue::SCORE_EPOCH_MS)
            * zhihui::tasks::queue::SCORES_PER_MS
    };
    for (wait_max_ms, queued_ms_ago, first) in [(60_000, 0, 1), (5_000, 10_000, 0)] {
        let mut tasks = Vec::new();
        for (offset, model) in [(0, "a"), (64, "b")] {
            let task_id = Uuid::now_v7();
            let score = score_at(queued_ms_ago) + offset;
            queue
                .enqueue(task_id, score, Some((model, 1)))
                .await
                .unwrap();
            tasks.push(task_id);
        }
        let names = process.dispatcher.backend_names();
        let servers = [server(&["a", "b"], Some("b")), None];
        let filled = leases
            .fill(
                &term,
                &FillPlan {
                    names: &names,
                    releases: &releases,
                    servers: &servers,
                    depth: 0,
                    slot_lease_ms: 10_000,
                    scan_max: 256,
                    prefer_same_model: true,
                    affinity_window: 16,
                    affinity_wait_max_ms: wait_max_ms,
                },
            )
            .await
            .unwrap();
        let claims = claims_of(filled);
        assert_eq!(claims, vec![(0, tasks[first])], "bound {wait_max_ms} ms");
        let left = tasks[1 - first];
        queue.remove(left).await.unwrap();
        fill(&process, &term, &claims, &[None, None]).await;
    }

    // A task queued without a model (its entry lost) may go to any server.
    let tasks = enqueue(vec![None]).await;
    let servers = [server(&["x"], None), None];
    let claims = claims_of(fill(&process, &term, &releases, &servers).await);
    assert_eq!(claims, vec![(0, tasks[0])]);
    leases.resign(&term).await.unwrap();
}

/// A leader that dies between claiming a task (its Lua step popped it and leased a slot) and
/// recording its dispatch leaves a lease with nothing behind it. The next leader frees that slot
/// as it takes over, and the task runs, instead of the slot staying taken until the lease runs
/// out (found with two `zhihui serve` processes: a killed leader cost a server 15 s).
#[tokio::test]
async fn a_claim_the_dead_leader_never_recorded_frees_its_slot_at_takeover() {
    let harness = harness(2, Faults::default()).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "claimed-only", "10").await;
    let task = submit_task(app, &token, 1, 1).await;
    app.project().await;
    let dead = harness.process();
    let term = dead
        .dispatcher
        .leases()
        .acquire("dies-after-claiming", 10_000)
        .await
        .unwrap()
        .expect("nobody else leads");
    let slots = Some(ServerSlots {
        capacity: 1,
        busy: 0,
        staged: 0,
        last_model: None,
        models: None,
    });
    let filled = fill(&dead, &term, &[], &[slots, None]).await;
    assert_eq!(
        filled,
        Fill::Claimed {
            claims: vec![Claimed {
                backend: 0,
                task_id: Uuid::parse_str(&task).unwrap(),
                score: status_of(&dead, &task).await.score.unwrap(),
            }],
            queue_empty: true,
        }
    );
    let leases = dead.dispatcher.leases().clone();
    assert_eq!(leases.busy_slots("gpu-0").await.unwrap().len(), 1);
    // It dies here: its leader lease is gone, the slot lease (10 s) is not.
    leases.resign(&term).await.unwrap();

    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    assert_eq!(
        leases.busy_slots("gpu-0").await.unwrap(),
        Vec::<Uuid>::new(),
        "the slot of a claim never recorded is still taken"
    );
    assert_eq!(process.tasks.queue.len().await.unwrap(), 1, "queued again");
    drive_until_connected(&mut saga, 2).await;
    drive_until(&mut saga, &process, &[task], &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;
    assert_settled(&harness, &process, &user, 9).await;
    saga.resign().await;
}
