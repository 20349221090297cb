//! The pool at run time: servers drained, resumed, added and removed through the admin
//! API without a restart, the pool recorded as events so a new leader starts from it, and tasks
//! routed by the models each server offers (`/object_info`).

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};

use comfyui_sim::Faults;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::dispatch::Saga;
use zhihui::state::AppState;
use zhihui_domain::task::TaskStatus;

use crate::dispatch::{
    DRIVE_LIMIT, Harness, TempDirectory, assert_settled, catalog_models, drive_until,
    drive_until_connected, drive_until_idle, harness_of_models, start_sim, status_of,
};
use crate::helpers::TestApp;
use crate::tasks::{funded_user, submit};

const MODEL_A: &str = "majicmixRealistic_v7.safetensors";
const MODEL_B: &str = "anythingelseV4_v45.safetensors";
const MODEL_C: &str = "dreamshaper_8.safetensors";
/// In the catalog, offered by no server.
const MODEL_NONE: &str = "absent_v1.safetensors";

fn catalog_of_four(settings: &mut zhihui::platform::configuration::Settings) {
    settings.tasks.models = vec![
        MODEL_A.into(),
        MODEL_B.into(),
        MODEL_C.into(),
        MODEL_NONE.into(),
    ];
    settings.tasks.queued_per_user_max = 1_000;
    // Small images: hundreds of tasks, each labelled and stored.
    settings.tasks.resolution_presets.push("64x64".into());
    settings.dispatch.status_publish_interval_ms = 20;
}

async fn submit_for(app: &TestApp, token: &str, model: &str, steps: u32) -> reqwest::Response {
    submit(
        app,
        token,
        &json!({"prompt": "a lighthouse at dusk", "model": model, "images": 1, "steps": steps, "resolution": "64x64"}),
        None,
    )
    .await
}

async fn submitted(app: &TestApp, token: &str, model: &str, steps: u32) -> String {
    let response = submit_for(app, token, model, steps).await;
    assert_eq!(response.status(), 201, "{model}");
    let body: Value = response.json().await.unwrap();
    body["task_id"].as_str().unwrap().to_owned()
}

/// Step until the pool stream records what each of `count` servers offers (the leader asks
/// each server at connect, and records what it said).
async fn drive_until_inspected(saga: &mut Saga, process: &AppState, count: usize) {
    let started = tokio::time::Instant::now();
    loop {
        let pool = process.dispatcher.backend_pool().load().await.unwrap();
        let known = pool
            .backends
            .iter()
            .filter(|backend| backend.models.is_some())
            .count();
        if known >= count {
            return;
        }
        assert!(started.elapsed() < DRIVE_LIMIT, "servers never inspected");
        saga.step().await.unwrap();
    }
}

/// Step until every one of many tasks succeeded: one task's stream is read per step (the first
/// not known to have succeeded), so a long list does not starve the saga of steps.
async fn drive_until_all_succeeded(saga: &mut Saga, process: &AppState, tasks: &[String]) {
    let started = tokio::time::Instant::now();
    let mut pending: std::collections::VecDeque<&String> = tasks.iter().collect();
    while let Some(task) = pending.front() {
        if status_of(process, task).await.status == TaskStatus::Succeeded {
            pending.pop_front();
            continue;
        }
        assert!(
            started.elapsed() < DRIVE_LIMIT,
            "{} task(s) never succeeded",
            pending.len()
        );
        for _ in 0..20 {
            saga.step().await.unwrap();
        }
    }
}

/// Step until `GET /admin/backends` shows `name` in `state`.
async fn drive_until_state(saga: &mut Saga, app: &TestApp, admin: &str, name: &str, state: &str) {
    let started = tokio::time::Instant::now();
    loop {
        let list = backends(app, admin).await;
        if list[name]["state"] == state {
            return;
        }
        assert!(
            started.elapsed() < DRIVE_LIMIT,
            "{name} never became {state}: {}",
            list[name]
        );
        saga.step().await.unwrap();
    }
}

/// `GET /admin/backends` by name.
async fn backends(app: &TestApp, admin: &str) -> HashMap<String, Value> {
    let response = app.get_as(admin, "/api/v1/admin/backends").await;
    assert_eq!(response.status(), 200);
    let list: Vec<Value> = response.json().await.unwrap();
    list.into_iter()
        .map(|item| (item["name"].as_str().unwrap().to_owned(), item))
        .collect()
}

async fn admin_post(app: &TestApp, admin: &str, path: &str, body: &Value) -> reqwest::Response {
    app.post(path, Some(admin), body).await
}

async fn backend_of(process: &AppState, task: &str) -> String {
    status_of(process, task)
        .await
        .backend
        .expect("the task was dispatched")
}

#[tokio::test]
async fn servers_are_drained_resumed_added_and_removed_at_run_time_and_a_new_leader_keeps_the_pool()
{
    // Slow steps: a task runs long enough to be running when its server is drained.
    let faults = Faults {
        step_delay_ms: 40,
        ..Faults::default()
    };
    let harness: Harness = harness_of_models(vec![catalog_models(); 2], faults, |settings| {
        catalog_of_four(settings);
        // Requests between steps must not outlast the lease; the takeover below waits it out.
        // The slot leases outlive it, so the next leader finds the task in flight by its lease.
        settings.dispatch.leader_lease_ms = 5_000;
        settings.dispatch.slot_lease_ms = 10_000;
    })
    .await;
    let app = &harness.app;
    let admin = app.admin_token("pool-admin").await;
    let (user, token) = funded_user(app, "pool-user", "100").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 2).await;
    drive_until_inspected(&mut saga, &process, 2).await;

    // Both servers up, with their models and version.
    drive_until_state(&mut saga, app, &admin, "gpu-0", "up").await;
    let list = backends(app, &admin).await;
    assert_eq!(list.len(), 2);
    assert_eq!(list["gpu-1"]["models"], json!([MODEL_B, MODEL_A]));
    assert_eq!(list["gpu-1"]["capacity"], 1);
    assert!(list["gpu-1"]["version"].is_string());

    // A task runs; its server is drained mid-run: the task finishes there, nothing new goes
    // there, the other server takes the queue.
    let first = submitted(app, &token, MODEL_A, 20).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&first),
        &[TaskStatus::Running],
    )
    .await;
    let drained = backend_of(&process, &first).await;
    let other = if drained == "gpu-0" { "gpu-1" } else { "gpu-0" };
    let response = admin_post(
        app,
        &admin,
        &format!("/api/v1/admin/backends/{drained}/drain"),
        &json!({}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["draining"], true);
    drive_until_state(&mut saga, app, &admin, &drained, "draining").await;
    let queued: Vec<String> = vec![
        submitted(app, &token, MODEL_A, 2).await,
        submitted(app, &token, MODEL_B, 2).await,
        submitted(app, &token, MODEL_A, 2).await,
    ];
    let mut all = queued.clone();
    all.push(first.clone());
    drive_until(&mut saga, &process, &all, &[TaskStatus::Succeeded]).await;
    assert_eq!(
        backend_of(&process, &first).await,
        drained,
        "it finished where it ran"
    );
    for task in &queued {
        assert_eq!(
            backend_of(&process, task).await,
            other,
            "nothing new on {drained}"
        );
    }
    drive_until_state(&mut saga, app, &admin, &drained, "drained").await;

    // A busy server cannot be removed; an unknown one is 404.
    let busy_task = submitted(app, &token, MODEL_A, 20).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&busy_task),
        &[TaskStatus::Running],
    )
    .await;
    let refused = app
        .http
        .delete(format!("{}/api/v1/admin/backends/{other}", app.address))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/backend-busy", "{problem}");
    let unknown = admin_post(app, &admin, "/api/v1/admin/backends/nope/drain", &json!({})).await;
    assert_eq!(unknown.status(), 404);
    drive_until(&mut saga, &process, &[busy_task], &[TaskStatus::Succeeded]).await;

    // Resumed: both servers take tasks again.
    let response = admin_post(
        app,
        &admin,
        &format!("/api/v1/admin/backends/{drained}/resume"),
        &json!({}),
    )
    .await;
    assert_eq!(response.status(), 200);
    // Until the leader has followed the pool it takes no task there, and the state says so;
    // the admin page reads its table again meanwhile.
    assert_eq!(backends(app, &admin).await[&drained]["state"], "resuming");
    let table = || async {
        app.http
            .get(format!("{}/admin/servers", app.address))
            .header("Cookie", format!("lang=zh; zhihui_session={admin}"))
            .header("HX-Request", "true")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let settling = table().await;
    assert!(settling.contains("恢复中"), "{settling}");
    assert!(settling.contains(r#"hx-trigger="every 2s""#), "{settling}");
    assert!(!settling.contains("<html"), "a fragment: {settling}");
    drive_until_state(&mut saga, app, &admin, &drained, "up").await;
    let settled = table().await;
    assert!(!settled.contains("every 2s"), "settled: {settled}");
    let pair = vec![
        submitted(app, &token, MODEL_A, 10).await,
        submitted(app, &token, MODEL_A, 10).await,
    ];
    drive_until(&mut saga, &process, &pair, &[TaskStatus::Succeeded]).await;
    let mut used = vec![
        backend_of(&process, &pair[0]).await,
        backend_of(&process, &pair[1]).await,
    ];
    used.sort();
    assert_eq!(used, vec!["gpu-0".to_owned(), "gpu-1".to_owned()]);

    // A third server added at run time (no restart): it connects, is inspected, takes tasks.
    let third_directory =
        TempDirectory(std::env::temp_dir().join(format!("zhihui-pool-third-{}", Uuid::now_v7())));
    let third = start_sim(&third_directory.0, 2, catalog_models(), Faults::default()).await;
    let bad = admin_post(
        app,
        &admin,
        "/api/v1/admin/backends",
        &json!({"name": "gpu 2", "url": third.base_url()}),
    )
    .await;
    assert_eq!(bad.status(), 422);
    let problem: Value = bad.json().await.unwrap();
    assert!(problem.to_string().contains("name"), "{problem}");
    let added = admin_post(
        app,
        &admin,
        "/api/v1/admin/backends",
        &json!({"name": "gpu-2", "url": third.base_url(), "capacity": 1}),
    )
    .await;
    assert_eq!(added.status(), 201);
    let taken = admin_post(
        app,
        &admin,
        "/api/v1/admin/backends",
        &json!({"name": "gpu-2", "url": "http://elsewhere:8188"}),
    )
    .await;
    assert_eq!(taken.status(), 409);
    // The page tells the admin, in their language, that the configuration does not name it,
    // and both ways to settle that.
    let listed = table().await;
    assert!(
        listed.contains("服务器池里有 gpu-2，配置文件里没有：在 dispatch.backends 里写上它"),
        "{listed}"
    );
    assert!(
        listed.contains("<code>zhihui backends remove gpu-2</code>"),
        "{listed}"
    );
    assert!(!listed.contains("not configured"), "{listed}");
    drive_until_connected(&mut saga, 3).await;
    drive_until_inspected(&mut saga, &process, 3).await;
    let three = vec![
        submitted(app, &token, MODEL_B, 10).await,
        submitted(app, &token, MODEL_B, 10).await,
        submitted(app, &token, MODEL_B, 10).await,
    ];
    drive_until(&mut saga, &process, &three, &[TaskStatus::Succeeded]).await;
    let mut used = Vec::new();
    for task in &three {
        used.push(backend_of(&process, task).await);
    }
    used.sort();
    assert_eq!(used, vec!["gpu-0", "gpu-1", "gpu-2"], "one task per server");

    // The leader dies mid-way, the third server drained: the next leader (another process)
    // starts from the same pool, three servers, the third still drained.
    let response = admin_post(
        app,
        &admin,
        "/api/v1/admin/backends/gpu-2/drain",
        &json!({}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let mid_run = submitted(app, &token, MODEL_A, 10).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&mid_run),
        &[TaskStatus::Running],
    )
    .await;
    drop(saga);
    let next = harness.process();
    let mut saga = harness.lead(&next).await;
    drive_until_connected(&mut saga, 3).await;
    let after: Vec<String> = vec![
        submitted(app, &token, MODEL_A, 2).await,
        submitted(app, &token, MODEL_B, 2).await,
    ];
    let mut everything = after.clone();
    everything.push(mid_run.clone());
    drive_until(&mut saga, &next, &everything, &[TaskStatus::Succeeded]).await;
    for task in &after {
        assert_ne!(backend_of(&next, task).await, "gpu-2", "still drained");
    }
    drive_until_state(&mut saga, app, &admin, "gpu-2", "drained").await;

    // Removed once drained and idle: gone from the list; the pool stays two servers for the
    // next leader (the configuration does not bring it back).
    let removed = app
        .http
        .delete(format!("{}/api/v1/admin/backends/gpu-2", app.address))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 204);
    let list = backends(app, &admin).await;
    assert_eq!(
        list.keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        ["gpu-0".to_owned(), "gpu-1".to_owned()].into()
    );
    drive_until_idle(&mut saga).await;
    // 1 point per image, 13 tasks.
    assert_settled(&harness, &next, &user, 100 - 13).await;
    drop(third);
    saga.resign().await;
}

/// Two servers with different models: every task runs on a server that offers its model, a
/// model no server offers is refused at submit (409 naming it), a task whose only server is
/// drained waits queued, and the preference for the model a server ran last cuts its switches.
#[tokio::test]
async fn tasks_run_only_where_their_model_is_and_the_same_model_is_preferred() {
    let mut switches = BTreeMap::new();
    for prefer in [true, false] {
        let harness = harness_of_models(
            vec![
                vec![MODEL_A.to_owned(), MODEL_B.to_owned()],
                vec![MODEL_B.to_owned(), MODEL_C.to_owned()],
            ],
            Faults::default(),
            move |settings| {
                catalog_of_four(settings);
                settings.dispatch.prefer_same_model = prefer;
                // 200 submits between two steps must not outlast the lease.
                settings.dispatch.leader_lease_ms = 30_000;
                settings.dispatch.slot_lease_ms = 30_000;
            },
        )
        .await;
        let app = &harness.app;
        let admin = app.admin_token("route-admin").await;
        let (user, token) = funded_user(app, "route-user", "1000").await;
        let process = harness.process();
        let mut saga = harness.lead(&process).await;
        drive_until_connected(&mut saga, 2).await;
        drive_until_inspected(&mut saga, &process, 2).await;

        // No server offers it: refused at once, naming it, nothing frozen.
        let refused = submit_for(app, &token, MODEL_NONE, 2).await;
        assert_eq!(refused.status(), 409);
        let problem: Value = refused.json().await.unwrap();
        assert_eq!(problem["type"], "/problems/model-unavailable");
        assert!(
            problem["detail"].as_str().unwrap().contains(MODEL_NONE),
            "{problem}"
        );

        // 200 tasks of the three models in a fixed random order.
        let models = [MODEL_A, MODEL_B, MODEL_C];
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut tasks = Vec::new();
        for _ in 0..200 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let model = models[(state % 3) as usize];
            tasks.push((submitted(app, &token, model, 1).await, model));
        }
        let ids: Vec<String> = tasks.iter().map(|(task, _)| task.clone()).collect();
        drive_until_all_succeeded(&mut saga, &process, &ids).await;
        for (task, model) in &tasks {
            let backend = backend_of(&process, task).await;
            let offers = match backend.as_str() {
                "gpu-0" => [MODEL_A, MODEL_B],
                _ => [MODEL_B, MODEL_C],
            };
            assert!(offers.contains(model), "{model} ran on {backend}");
        }
        switches.insert(prefer, saga.model_switches());

        // C's only server drained: a C task waits, queued, while A runs; resumed, it runs.
        let drained = admin_post(
            app,
            &admin,
            "/api/v1/admin/backends/gpu-1/drain",
            &json!({}),
        )
        .await;
        assert_eq!(drained.status(), 200);
        drive_until_state(&mut saga, app, &admin, "gpu-1", "drained").await;
        let waiting = submitted(app, &token, MODEL_C, 1).await;
        let runs = submitted(app, &token, MODEL_A, 1).await;
        drive_until(&mut saga, &process, &[runs], &[TaskStatus::Succeeded]).await;
        assert_eq!(
            status_of(&process, &waiting).await.status,
            TaskStatus::Queued
        );
        let resumed = admin_post(
            app,
            &admin,
            "/api/v1/admin/backends/gpu-1/resume",
            &json!({}),
        )
        .await;
        assert_eq!(resumed.status(), 200);
        drive_until(
            &mut saga,
            &process,
            std::slice::from_ref(&waiting),
            &[TaskStatus::Succeeded],
        )
        .await;
        assert_eq!(backend_of(&process, &waiting).await, "gpu-1");
        drive_until_idle(&mut saga).await;
        assert_settled(&harness, &process, &user, 1000 - 202).await;
        saga.resign().await;
    }
    // The figures for the record (`--no-capture`).
    #[allow(clippy::print_stderr)]
    {
        eprintln!(
            "model switches per server over 200 tasks: with the preference {:?}, without {:?}",
            switches[&true], switches[&false]
        );
    }
    let total = |prefer: bool| switches[&prefer].iter().map(|(_, n)| n).sum::<u64>();
    assert!(
        total(true) < total(false),
        "the preference did not cut model switches: {switches:?}"
    );
}

/// Queued tasks show when they should start and end, from the step times measured on the server
/// and what runs there; a task whose model no server in service offers says so instead.
#[tokio::test]
async fn queued_tasks_show_wait_estimates_from_measured_step_times() {
    let faults = Faults {
        step_delay_ms: 20,
        ..Faults::default()
    };
    let harness = harness_of_models(vec![catalog_models()], faults, |settings| {
        catalog_of_four(settings);
        // Nothing staged: what waits stays in the queue, where it is estimated.
        settings.dispatch.staged_per_backend = 0;
        settings.dispatch.posted_ahead_per_backend = 0;
        settings.dispatch.leader_lease_ms = 30_000;
        settings.dispatch.slot_lease_ms = 30_000;
    })
    .await;
    let app = &harness.app;
    let admin = app.admin_token("estimate-admin").await;
    let (_, token) = funded_user(app, "estimate-user", "100").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    drive_until_inspected(&mut saga, &process, 1).await;

    // Two runs measure the server's step time for the model.
    let warm_up = vec![
        submitted(app, &token, MODEL_A, 10).await,
        submitted(app, &token, MODEL_A, 10).await,
    ];
    drive_until(&mut saga, &process, &warm_up, &[TaskStatus::Succeeded]).await;

    // The owner's socket: its position notices carry the estimates too.
    let mut socket = app.socket(&token).await;
    let tasks = [
        submitted(app, &token, MODEL_A, 10).await,
        submitted(app, &token, MODEL_A, 10).await,
        submitted(app, &token, MODEL_A, 10).await,
    ];
    drive_until(&mut saga, &process, &tasks[..1], &[TaskStatus::Running]).await;
    // Until the leader published a view with the measure and the running task in it.
    let started = tokio::time::Instant::now();
    loop {
        let list = process.dispatcher.backend_pool().list().await.unwrap();
        let status = list[0].status.as_ref();
        if status
            .is_some_and(|s| s.seconds_per_step.contains_key(MODEL_A) && s.prompts_in_flight == 1)
        {
            break;
        }
        assert!(started.elapsed() < DRIVE_LIMIT, "no view with a measure");
        saga.step().await.unwrap();
    }
    // The list reads the read model.
    app.project().await;
    let page: Value = app
        .get_as(&token, "/api/v1/tasks?limit=10")
        .await
        .json()
        .await
        .unwrap();
    let view = |task: &str| {
        page["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|view| view["task_id"] == task)
            .cloned()
            .unwrap()
    };
    let at = |value: &Value| {
        chrono::DateTime::parse_from_rfc3339(value.as_str().unwrap())
            .unwrap()
            .with_timezone(&chrono::Utc)
    };
    let (second, third) = (view(&tasks[1]), view(&tasks[2]));
    assert_eq!(second["position"], 1);
    assert_eq!(third["position"], 2);
    let (second_start, second_end) = (
        at(&second["estimated_start_at"]),
        at(&second["estimated_end_at"]),
    );
    let (third_start, third_end) = (
        at(&third["estimated_start_at"]),
        at(&third["estimated_end_at"]),
    );
    // One server: the third starts when the second ends; each run takes about what was measured
    // (10 steps at ~20 ms, plus the run's overhead), never less than the overhead.
    assert_eq!(third_start, second_end);
    for (start, end) in [(second_start, second_end), (third_start, third_end)] {
        let run = (end - start).num_milliseconds();
        assert!((500..5_000).contains(&run), "a run of {run} ms");
    }
    assert!(second_start >= at(&second["submitted_at"]));
    assert!(second["estimate_note"].is_null());
    let single: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{}", tasks[2]))
        .await
        .json()
        .await
        .unwrap();
    assert!(single["estimated_start_at"].is_string(), "{single}");
    let notice = tokio::time::timeout(DRIVE_LIMIT, async {
        use futures::StreamExt;
        while let Some(Ok(frame)) = socket.next().await {
            let async_tungstenite::tungstenite::Message::Text(text) = frame else {
                continue;
            };
            let message: Value = serde_json::from_str(&text).unwrap();
            if message["type"] == "position"
                && message["task_id"] == tasks[2].as_str()
                && message["estimated_start_at"].is_string()
            {
                return message;
            }
        }
        panic!("the socket ended");
    })
    .await
    .expect("a position notice with an estimate");
    assert!(notice["estimated_end_at"].is_string(), "{notice}");

    // The only server drained: the queued tasks wait for one, and say so.
    let drained = admin_post(
        app,
        &admin,
        "/api/v1/admin/backends/gpu-0/drain",
        &json!({}),
    )
    .await;
    assert_eq!(drained.status(), 200);
    drive_until_state(&mut saga, app, &admin, "gpu-0", "drained").await;
    let waiting: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{}", tasks[2]))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(waiting["status"], "queued");
    assert!(waiting["estimated_start_at"].is_null(), "{waiting}");
    assert!(
        waiting["estimate_note"]
            .as_str()
            .unwrap()
            .contains("no image server"),
        "{waiting}"
    );
    assert_eq!(waiting["estimate_reason"], "no_server", "{waiting}");
    // The page says it in its reader's words.
    let card = app
        .http
        .get(format!("{}/tasks/{}/card", app.address, tasks[2]))
        .header("Cookie", format!("lang=zh; zhihui_session={token}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(card.contains("现在没有接单的图像服务器"), "{card}");
    assert!(!card.contains("no image server"), "{card}");
    saga.resign().await;
}

/// A drain holds its server in Redis for the filler from its answer on; the leader rewrites that
/// set from each pool it reads, but a pool read before the drain never undoes it.
#[tokio::test]
async fn a_pool_read_before_a_drain_never_undoes_its_hold() {
    let harness = harness_of_models(vec![catalog_models(); 2], Faults::default(), |_| {}).await;
    let process = harness.process();
    let pool = process.dispatcher.backend_pool();
    let configured: Vec<zhihui::platform::configuration::BackendSettings> = process
        .dispatcher
        .backend_names()
        .iter()
        .zip(&harness.sims)
        .map(
            |(name, sim)| zhihui::platform::configuration::BackendSettings {
                name: name.clone(),
                url: sim.base_url(),
                capacity: 1,
            },
        )
        .collect();
    let before = pool.seed(&configured).await.unwrap();
    pool.drain("gpu-1", "test").await.unwrap();
    let held = || async {
        let services = harness.app.services();
        let mut redis = services.redis.connection().await.unwrap();
        let mut names: Vec<String> = redis::cmd("SMEMBERS")
            .arg(services.redis.tagged(
                zhihui::tasks::queue::QUEUE_TAG,
                zhihui::tasks::queue::HELD_KEY,
            ))
            .query_async(&mut redis)
            .await
            .unwrap();
        names.sort();
        names
    };
    assert_eq!(held().await, vec!["gpu-1".to_owned()]);
    // A leader that read the pool before the drain writes what it read: refused.
    pool.hold(&before).await.unwrap();
    assert_eq!(held().await, vec!["gpu-1".to_owned()]);
    // Resumed: the newer pool clears it.
    pool.resume("gpu-1", "test").await.unwrap();
    assert!(held().await.is_empty());
}

/// The configuration seeds the pool once; a configuration changed later is reported
/// at every start and by `zhihui backends list`, each difference with the command that applies
/// it, and applied only on purpose (`zhihui backends apply-config`), as pool events, never
/// removing or moving a server while a prompt runs there.
#[tokio::test]
async fn a_changed_configuration_is_reported_and_applied_only_on_purpose() {
    use tokio::io::AsyncBufReadExt;

    let faults = Faults {
        step_delay_ms: 40,
        ..Faults::default()
    };
    let harness = harness_of_models(vec![catalog_models(); 2], faults.clone(), |settings| {
        catalog_of_four(settings);
        settings.dispatch.leader_lease_ms = 10_000;
        settings.dispatch.slot_lease_ms = 10_000;
    })
    .await;
    let app = &harness.app;
    let admin = app.admin_token("operator").await;
    let (user, token) = funded_user(app, "config-user", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 2).await;

    // A task runs on one server: the one the new configuration drops.
    let running = submitted(app, &token, MODEL_A, 30).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&running),
        &[TaskStatus::Running],
    )
    .await;
    let dropped = backend_of(&process, &running).await;
    let kept = if dropped == "gpu-0" { "gpu-1" } else { "gpu-0" };
    let kept_url = backends(app, &admin).await[kept]["url"]
        .as_str()
        .unwrap()
        .to_owned();
    let added = start_sim(&harness.directory.0, 2, catalog_models(), faults).await;
    // The operator edits the configuration: `kept` gets capacity 2, gpu-2 is new, `dropped` is
    // gone.
    let configured = format!("{kept} {kept_url} 2,gpu-2 {} 1", added.base_url());
    let with_config = [("ZHIHUI_DISPATCH__BACKENDS", configured.as_str())];

    // At start: one warning per difference, naming the command that applies it; the pool is used.
    let images = harness.directory.0.join("images");
    let mut started = crate::processes::serve_capturing(
        app,
        &configured,
        &images,
        &[
            ("ZHIHUI_DISPATCH__ENABLED", "false"),
            ("ZHIHUI_LOG__FILTER", "warn"),
        ],
        true,
    )
    .await;
    let mut lines = tokio::io::BufReader::new(started.child.stderr.take().unwrap()).lines();
    let mut warned = Vec::new();
    while !warned
        .iter()
        .any(|line: &String| line.contains("apply-config"))
    {
        let line = tokio::time::timeout(DRIVE_LIMIT, lines.next_line())
            .await
            .expect("the start warned of the differences")
            .unwrap()
            .expect("the log ended before the warning");
        warned.push(line);
    }
    let warned = warned.join("\n");
    for expected in [
        format!("zhihui backends reconfigure {kept} {kept_url} --capacity 2"),
        format!(
            "zhihui backends add gpu-2 {} --capacity 1",
            added.base_url()
        ),
        format!("zhihui backends remove {dropped}"),
        format!("{dropped} is in the pool but not configured"),
    ] {
        assert!(warned.contains(&expected), "{expected} not in: {warned}");
    }
    drop(started);

    // `zhihui backends list` shows the same.
    let listed = app.cli_with(&["backends", "list"], &with_config);
    let listed_text = String::from_utf8(listed.stdout).unwrap();
    assert!(listed.status.success(), "{listed_text}");
    assert!(
        listed_text.contains("dispatch.backends differs from the pool"),
        "{listed_text}"
    );
    assert!(listed_text.contains(&format!("apply: zhihui backends remove {dropped}")));
    let listed_json = app.cli_with(&["backends", "list", "--json"], &with_config);
    let listed_json: Value = serde_json::from_slice(&listed_json.stdout).unwrap();
    assert_eq!(
        listed_json["configuration_differences"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    // Nothing changed by looking: the pool is as it was.
    assert_eq!(backends(app, &admin).await.len(), 2);

    // Applied while `dropped` still runs its prompt: the rest applies, that one is refused.
    let applied = app.cli_with(&["backends", "apply-config"], &with_config);
    let applied_text = String::from_utf8(applied.stdout).unwrap();
    assert!(!applied.status.success(), "{applied_text}");
    assert!(
        applied_text.contains(&format!("not applied: {dropped} is in the pool but not configured: server {dropped} has 1 prompt(s) in flight")),
        "{applied_text}"
    );
    assert!(applied_text.contains("applied: gpu-2"), "{applied_text}");
    let list = backends(app, &admin).await;
    assert_eq!(list.len(), 3);
    assert_eq!(list[kept]["capacity"], 2);
    assert_eq!(list[&dropped]["draining"], true, "drained meanwhile");

    // Once it is idle, applying again removes it; then nothing differs.
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&running),
        &[TaskStatus::Succeeded],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let applied = app.cli_with(&["backends", "apply-config"], &with_config);
    let applied_text = String::from_utf8(applied.stdout).unwrap();
    assert!(applied.status.success(), "{applied_text}");
    assert!(applied_text.contains(&format!(
        "applied: {dropped} is in the pool but not configured"
    )));
    let again = app.cli_with(&["backends", "apply-config"], &with_config);
    assert!(
        String::from_utf8(again.stdout)
            .unwrap()
            .contains("nothing to apply")
    );
    let list = backends(app, &admin).await;
    let mut names: Vec<&String> = list.keys().collect();
    names.sort();
    let mut expected = [kept.to_owned(), "gpu-2".to_owned()];
    expected.sort();
    assert_eq!(names, expected.iter().collect::<Vec<_>>());
    // Every change is a pool event, by the CLI.
    use zhihui::platform::event_store::EventStore;
    let events = process
        .event_store
        .read_stream(
            zhihui_domain::pool::POOL_STREAM,
            zhihui::platform::event_store::Direction::Forwards,
            zhihui::platform::event_store::ReadFrom::Start,
            100,
        )
        .await
        .unwrap();
    let mut by_cli: Vec<&str> = events
        .iter()
        .filter(|event| event.metadata.actor == "cli:backends")
        .map(|event| event.event_type.as_str())
        .collect();
    by_cli.sort_unstable();
    // The server configured away was drained while its prompt ran, then removed.
    assert_eq!(
        by_cli,
        [
            "BackendAdded",
            "BackendDrained",
            "BackendReconfigured",
            "BackendRemoved"
        ]
    );

    // The leader follows: the reconfigured server takes two at once, gpu-2 takes tasks.
    drive_until_connected(&mut saga, 2).await;
    let tasks = vec![
        submitted(app, &token, MODEL_A, 2).await,
        submitted(app, &token, MODEL_A, 2).await,
        submitted(app, &token, MODEL_A, 2).await,
    ];
    drive_until(&mut saga, &process, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;
    for task in &tasks {
        assert_ne!(backend_of(&process, task).await, dropped);
    }
    assert_settled(&harness, &process, &user, 10 - 4).await;
    saga.resign().await;
}

/// A GPU loads a checkpoint when a prompt names another than the one before (the simulator's
/// `model_load_ms`, its loader node not cached): the leader measures that load apart from the
/// step time, from the runs it posted after another model, and a queued task's estimate carries
/// it only where the server will switch.
#[tokio::test]
async fn a_model_load_is_measured_apart_from_the_steps_and_estimated_only_where_a_switch_comes() {
    let faults = Faults {
        step_delay_ms: 50,
        model_load_ms: 1_000,
        ..Faults::default()
    };
    let harness = harness_of_models(
        vec![vec![MODEL_A.to_owned(), MODEL_B.to_owned()]],
        faults,
        |settings| {
            catalog_of_four(settings);
            settings.dispatch.staged_per_backend = 0;
            settings.dispatch.posted_ahead_per_backend = 0;
            settings.dispatch.leader_lease_ms = 30_000;
            settings.dispatch.slot_lease_ms = 30_000;
        },
    )
    .await;
    let app = &harness.app;
    let (_, token) = funded_user(app, "load-user", "100").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    drive_until_inspected(&mut saga, &process, 1).await;

    // A (loads it), A, B (loads it), B, A (loads it again): one at a time, in this order.
    for model in [MODEL_A, MODEL_A, MODEL_B, MODEL_B, MODEL_A] {
        let task = submitted(app, &token, model, 10).await;
        drive_until(&mut saga, &process, &[task], &[TaskStatus::Succeeded]).await;
    }
    let started = tokio::time::Instant::now();
    let status = loop {
        let list = process.dispatcher.backend_pool().list().await.unwrap();
        if let Some(status) = list[0].status.clone()
            && status.load_seconds.len() == 2
        {
            break status;
        }
        assert!(started.elapsed() < DRIVE_LIMIT, "no loads measured");
        saga.step().await.unwrap();
    };
    for model in [MODEL_A, MODEL_B] {
        let load = status.load_seconds[model];
        assert!((0.6..2.0).contains(&load), "{model}: a load of {load} s");
        // 50 ms a step, the load not spread over them.
        let rate = status.seconds_per_step[model];
        assert!(rate < 0.06, "{model}: {rate} s a step");
    }

    // A runs long; behind it B (the server switches) and B again (it does not).
    let running = submitted(app, &token, MODEL_A, 50).await;
    let switching = submitted(app, &token, MODEL_B, 10).await;
    let following = submitted(app, &token, MODEL_B, 10).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&running),
        &[TaskStatus::Running],
    )
    .await;
    for _ in 0..20 {
        saga.step().await.unwrap();
    }
    let run_of = |task: &String| {
        let path = format!("/api/v1/tasks/{task}");
        let token = token.clone();
        async move {
            let view: Value = app.get_as(&token, &path).await.json().await.unwrap();
            let at = |key: &str| {
                chrono::DateTime::parse_from_rfc3339(view[key].as_str().unwrap_or_else(|| {
                    panic!("{key} in {view}");
                }))
                .unwrap()
            };
            (at("estimated_end_at") - at("estimated_start_at")).num_milliseconds()
        }
    };
    let (with_load, without) = (run_of(&switching).await, run_of(&following).await);
    assert!(
        (600..2_000).contains(&(with_load - without)),
        "a run after a switch {with_load} ms, the one behind it {without} ms"
    );
    drive_until(
        &mut saga,
        &process,
        &[running, switching, following],
        &[TaskStatus::Succeeded],
    )
    .await;
    saga.resign().await;
}
