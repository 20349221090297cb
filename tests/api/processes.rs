//! Two `zhihui serve` OS processes (the real binary, product timings for leadership) on one
//! database, one Redis and two ComfyUI simulators: the user's socket is on the process that does
//! not dispatch and still hears everything about their tasks, and prioritises and cancels there
//! (queued and in flight) while the other dispatches and settles; the dispatching process is killed
//! with SIGKILL mid-run and the other takes over within 5 s; every task ends once, every hold is
//! settled once, no slot stays leased and `zhihui audit verify` passes.
//!
//! Nothing here is stepped: these are separate processes. The test waits on what they say
//! (socket frames, the leader key), each wait bounded. Also: a code generator SIGKILLed mid-batch
//! and resumed by another process; 50 check-ins of one user through both processes.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::time::Duration;
use zhihui::platform::redis_store::RedisConnection;

use comfyui_sim::{Faults, SimConfig, Simulator};
use futures::StreamExt;
use secrecy::ExposeSecret;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui_domain::points::Points;
use zhihui_domain::task::TaskEvent;

use crate::helpers::{TestApp, spawn_app};
use crate::tasks::{account_of, project_and_verify, task_events};

/// Longest any one wait of this test may take (a hang, not a slow machine).
const WAIT_LIMIT: Duration = Duration::from_secs(60);
/// Another instance takes over within a few seconds: 5 at most.
const TAKEOVER_MAX: Duration = Duration::from_secs(5);

/// A `zhihui serve` child process; killed when dropped.
pub(crate) struct Serve {
    pub(crate) child: tokio::process::Child,
    pub(crate) address: String,
}

pub(crate) async fn serve(app: &TestApp, backends: &str, images: &std::path::Path) -> Serve {
    serve_with(app, backends, images, &[]).await
}

/// `serve` with more settings (`ZHIHUI_...` variables) for this process.
async fn serve_with(
    app: &TestApp,
    backends: &str,
    images: &std::path::Path,
    extra: &[(&str, &str)],
) -> Serve {
    serve_capturing(app, backends, images, extra, false).await
}

/// `serve_with`, its standard output and error piped to the test when `capture` is set.
pub(crate) async fn serve_capturing(
    app: &TestApp,
    backends: &str,
    images: &std::path::Path,
    extra: &[(&str, &str)],
    capture: bool,
) -> Serve {
    let output = || {
        if capture {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::inherit()
        }
    };
    let port = crate::helpers::free_port();
    let settings = &app.settings;
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_zhihui"))
        .arg("serve")
        .env(
            "ZHIHUI_DATABASE__URL",
            settings.database.url.expose_secret(),
        )
        .env("ZHIHUI_DATABASE__POOL_MAX_SIZE", "8")
        .env("ZHIHUI_REDIS__URL", settings.redis.url.expose_secret())
        .env(
            "ZHIHUI_REDIS__CLUSTER_NODES",
            settings.redis.cluster_nodes.expose_secret(),
        )
        .env("ZHIHUI_REDIS__KEY_PREFIX", &settings.redis.key_prefix)
        .env("ZHIHUI_HTTP__PORT", port.to_string())
        .env("ZHIHUI_HTTP__WORKERS", "1")
        .env("ZHIHUI_AUTH__LOGINS_PER_CLIENT_PER_MINUTE", "1000000")
        .env("ZHIHUI_TRANSLATION__ENABLED", "false")
        .env("ZHIHUI_DISPATCH__BACKENDS", backends)
        // Shared by both processes, as a shared volume would be: either serves any image.
        .env("ZHIHUI_DISPATCH__IMAGES_DIRECTORY", images)
        // Adopted prompts were posted for the dead leader's socket: their ends are found by the
        // watchdog, here every second instead of five.
        .env("ZHIHUI_DISPATCH__RECONCILE_INTERVAL_MS", "1000")
        .env("ZHIHUI_DISPATCH__PROGRESS_NOTIFY_INTERVAL_MS", "0")
        .env("ZHIHUI_LOG__FILTER", "warn")
        .envs(extra.iter().copied())
        .stdout(output())
        .stderr(output())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let address = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let started = tokio::time::Instant::now();
    loop {
        if let Ok(response) = http.get(format!("{address}/ready")).send().await
            && response.status() == 200
        {
            break;
        }
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "zhihui serve never got ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Serve { child, address }
}

/// `count` simulators offering the catalog's first model, 25 ms per step, under `directory`.
async fn slow_sims(directory: &std::path::Path, count: usize) -> Vec<Simulator> {
    let mut sims = Vec::new();
    for index in 0..count {
        sims.push(
            Simulator::start(SimConfig {
                bind: "127.0.0.1:0".parse().unwrap(),
                output_dir: directory.join(format!("sim-{index}")),
                models: vec!["majicmixRealistic_v7.safetensors".into()],
                faults: Faults {
                    step_delay_ms: 25,
                    ..Faults::default()
                },
            })
            .await
            .unwrap(),
        );
    }
    sims
}

/// The dispatcher leader lease's value (`<instance>:<fencing token>`), if anyone holds it.
async fn leader(redis: &mut RedisConnection, prefix: &str) -> Option<String> {
    redis::cmd("GET")
        .arg(format!("{prefix}:{{queue}}:dispatch:leader"))
        .query_async(redis)
        .await
        .unwrap()
}

async fn wait_for_leader(
    redis: &mut RedisConnection,
    prefix: &str,
    other_than: Option<&str>,
) -> String {
    let started = tokio::time::Instant::now();
    loop {
        if let Some(holder) = leader(redis, prefix).await
            && Some(holder.as_str()) != other_than
        {
            return holder;
        }
        assert!(started.elapsed() < WAIT_LIMIT, "nobody took the lead");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn the_dispatching_process_killed_mid_run_is_replaced_and_the_other_one_tells_the_user() {
    let app = spawn_app().await;
    let directory = std::env::temp_dir().join(format!("zhihui-processes-{}", Uuid::now_v7()));
    // 40 steps of 25 ms: a task runs for a second.
    let sims = slow_sims(&directory, 2).await;
    let backends = sims
        .iter()
        .enumerate()
        .map(|(index, sim)| format!("gpu-{index} {} 1", sim.base_url()))
        .collect::<Vec<_>>()
        .join(",");
    let images = directory.join("images");
    let prefix = app.settings.redis.key_prefix.clone();
    let mut redis = crate::helpers::redis_of(&app.settings).await;

    // The first process leads; only then does the second start.
    let mut dispatching = serve(&app, &backends, &images).await;
    let first_leader = wait_for_leader(&mut redis, &prefix, None).await;
    let other = serve(&app, &backends, &images).await;
    assert_eq!(
        leader(&mut redis, &prefix).await,
        Some(first_leader.clone())
    );

    // A user of the second process, with 20 points.
    let http = reqwest::Client::new();
    let (user, token) = funded_user_via(&app, &http, &other.address, "far-away", "20").await;

    let (mut socket, _) = async_tungstenite::tokio::connect_async(
        format!(
            "{}/api/v1/ws?token={token}",
            other.address.replace("http://", "ws://")
        )
        .as_str(),
    )
    .await
    .unwrap();
    let mut tasks = Vec::new();
    // Two servers, each running one and staging two: the last two wait in the queue.
    for _ in 0..8 {
        let submitted = http
            .post(format!("{}/api/v1/tasks", other.address))
            .bearer_auth(&token)
            .json(&json!({"prompt": "a lighthouse", "images": 1, "steps": 40}))
            .send()
            .await
            .unwrap();
        assert_eq!(submitted.status(), 201);
        let submitted: Value = submitted.json().await.unwrap();
        tasks.push(submitted["task_id"].as_str().unwrap().to_owned());
    }

    // Through the process that does not dispatch, while the other settles on the same account:
    // the last task moves ahead of the one before it (one fee), which is then cancelled while
    // queued (its point returns at once).
    let act = |action: &str, task: &str| {
        http.post(format!("{}/api/v1/tasks/{task}/{action}", other.address))
            .bearer_auth(&token)
            .send()
    };
    let moved = act("prioritise", &tasks[7]).await.unwrap();
    assert_eq!(moved.status(), 200);
    let cancelled = act("cancel", &tasks[6]).await.unwrap();
    assert_eq!(cancelled.status(), 200);
    let cancelled: Value = cancelled.json().await.unwrap();
    assert_eq!(cancelled["status"], "cancelled");
    let cancelled_while_queued = tasks[6].clone();

    // What the user hears, on the process that does not dispatch.
    let mut heard: HashMap<String, Vec<Value>> = HashMap::new();
    let mut next_message = async || -> Value {
        loop {
            let frame = tokio::time::timeout(WAIT_LIMIT, socket.next())
                .await
                .expect("the user's socket went quiet")
                .unwrap()
                .unwrap();
            if let async_tungstenite::tungstenite::Message::Text(text) = frame {
                let message: Value = serde_json::from_str(text.as_str()).unwrap();
                // The funding grant's `points_credited` may reach the socket when it opened
                // first: only the tasks' notices are heard here.
                if message["task_id"].is_string() {
                    return message;
                }
                assert_eq!(message["type"], "points_credited", "{message}");
            }
        }
    };
    // Both servers run a task: the leader is killed in the middle of them.
    let mut running = HashSet::new();
    while running.len() < 2 {
        let message = next_message().await;
        let task_id = message["task_id"].as_str().unwrap().to_owned();
        if message["type"] == "progress" {
            running.insert(task_id.clone());
        }
        heard.entry(task_id).or_default().push(message);
    }
    dispatching.child.start_kill().unwrap();
    let killed_at = tokio::time::Instant::now();
    dispatching.child.wait().await.unwrap();
    let successor = wait_for_leader(&mut redis, &prefix, Some(&first_leader)).await;
    let takeover = killed_at.elapsed();
    assert!(
        takeover < TAKEOVER_MAX,
        "the other process took over after {takeover:?}"
    );
    let token_of = |holder: &str| -> u64 { holder.rsplit(':').next().unwrap().parse().unwrap() };
    assert!(token_of(&successor) > token_of(&first_leader));

    // A task the new leader has not finished is cancelled through the other process: 202 while
    // it runs or waits on its server, 409 if it ended meanwhile.
    let cancelled_late = tasks[5].clone();
    let late = act("cancel", &cancelled_late).await.unwrap();
    assert!(
        [200, 202, 409].contains(&late.status().as_u16()),
        "{}",
        late.status()
    );
    // 200: it was still queued (under load the leaders had not claimed it yet): never dispatched.
    let late_while_queued = late.status() == 200;

    // Every task ends once, and the user hears it on the other process.
    let mut ended = HashSet::new();
    let mut succeeded = 0;
    while ended.len() < tasks.len() - 1 {
        let message = next_message().await;
        let task_id = message["task_id"].as_str().unwrap().to_owned();
        assert!(tasks.contains(&task_id), "heard of a task not theirs");
        if ["succeeded", "failed", "cancelled"].contains(&message["type"].as_str().unwrap()) {
            if task_id == cancelled_while_queued {
                continue;
            }
            assert!(ended.insert(task_id.clone()), "{task_id} ended twice");
            if message["type"] == "cancelled" && task_id == cancelled_late {
                heard.entry(task_id).or_default().push(message);
                continue;
            }
            assert_eq!(message["type"], "succeeded", "{message}");
            succeeded += 1;
            let image = message["images"][0].as_str().unwrap();
            let fetched = http
                .get(format!("{}{image}", other.address))
                .bearer_auth(&token)
                .send()
                .await
                .unwrap();
            assert_eq!(fetched.status(), 200);
            assert_eq!(&fetched.bytes().await.unwrap()[..4], b"\x89PNG");
        }
        heard.entry(task_id).or_default().push(message);
    }
    for task_id in &tasks {
        let events = task_events(&app, task_id).await;
        let count = |wanted: fn(&TaskEvent) -> bool| events.iter().filter(|e| wanted(e)).count();
        let dispatched = count(|e| matches!(e, TaskEvent::Dispatched(_)));
        let ends = count(|e| {
            matches!(
                e,
                TaskEvent::Succeeded(_) | TaskEvent::Failed(_) | TaskEvent::Cancelled(_)
            )
        });
        assert_eq!(ends, 1, "{events:?}");
        if *task_id == cancelled_while_queued || (*task_id == cancelled_late && late_while_queued) {
            assert_eq!(dispatched, 0, "{events:?}");
        } else {
            assert_eq!(dispatched, 1, "{events:?}");
        }
    }
    // Notifications are hints, at most once: the killed leader's `dispatched` of a task it had
    // just staged may be lost with it; the others reach the user's process.
    assert!(
        heard
            .values()
            .flatten()
            .any(|message| message["type"] == "dispatched"),
        "{heard:?}"
    );
    // Settled by the successor: a point per success and the one fee deducted, nothing frozen;
    // no slot left leased.
    assert!(succeeded >= 6, "{succeeded} succeeded");
    let account = account_of(&app, &user).await;
    assert_eq!(account.balance.available, Points::whole(20 - succeeded - 5));
    assert_eq!(account.balance.frozen, Points::ZERO);
    let services = app.services();
    let started = tokio::time::Instant::now();
    for backend in ["gpu-0", "gpu-1"] {
        // The last slot is released by the filler right after the last end.
        while !services
            .dispatcher
            .leases()
            .busy_slots(backend)
            .await
            .unwrap()
            .is_empty()
        {
            assert!(
                started.elapsed() < WAIT_LIMIT,
                "a slot of {backend} stays leased"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    drop(other);
    project_and_verify(&app).await;
    for sim in sims {
        sim.stop().await;
    }
    drop(std::fs::remove_dir_all(&directory));
}

/// A user registered through a process and granted `points` by an admin (`boss`) logged in
/// there: the user's id and bearer token.
pub(crate) async fn funded_user_via(
    app: &TestApp,
    http: &reqwest::Client,
    address: &str,
    name: &str,
    points: &str,
) -> (String, String) {
    app.admin_token("boss").await;
    let admin = login_via(http, address, "boss", "admin password").await;
    let registered: Value = http
        .post(format!("{address}/api/v1/auth/register"))
        .json(&json!({"username": name, "password": "correct horse battery"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let user = registered["id"].as_str().unwrap().to_owned();
    let token = login_via(http, address, name, "correct horse battery").await;
    let granted = http
        .post(format!("{address}/api/v1/admin/accounts/{user}/grants"))
        .bearer_auth(&admin)
        .json(&json!({"amount": points, "reason": "test"}))
        .send()
        .await
        .unwrap();
    assert_eq!(granted.status(), 201);
    (user, token)
}

/// Log in through a process; the bearer token.
async fn login_via(http: &reqwest::Client, address: &str, name: &str, password: &str) -> String {
    let answer: Value = http
        .post(format!("{address}/api/v1/auth/login"))
        .json(&json!({"username": name, "password": password}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    answer["token"].as_str().unwrap().to_owned()
}

/// A batch's progress through a process: (status, issued).
async fn batch_progress(
    http: &reqwest::Client,
    address: &str,
    admin: &str,
    batch: &str,
) -> (String, u64) {
    let view: Value = http
        .get(format!("{address}/api/v1/admin/code-batches/{batch}"))
        .bearer_auth(admin)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        view["status"].as_str().unwrap().to_owned(),
        view["issued"].as_u64().unwrap(),
    )
}

/// Ask a process for a batch of `count` codes valid for a day; its id.
async fn create_batch_via(
    http: &reqwest::Client,
    address: &str,
    admin: &str,
    count: u32,
) -> String {
    let now = chrono::Utc::now();
    let response = http
        .post(format!("{address}/api/v1/admin/code-batches"))
        .bearer_auth(admin)
        .json(&json!({
            "count": count, "points": "5", "note": "processes",
            "valid_from": now - chrono::Duration::hours(1),
            "valid_until": now + chrono::Duration::days(1),
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    let view: Value = response.json().await.unwrap();
    view["batch_id"].as_str().unwrap().to_owned()
}

/// The batch's `CodesIssued` pages as (from serial, count), from its stream, and its first serial.
async fn issued_pages(app: &TestApp, batch: &str) -> (u32, Vec<(u32, u32)>) {
    use zhihui::platform::event_store::{Direction, EventStore, ReadFrom};
    use zhihui_domain::redeem::{BatchEvent, batch_stream};
    let stream = batch_stream(Uuid::parse_str(batch).unwrap());
    let mut first = None;
    let mut pages = Vec::new();
    let mut from = ReadFrom::Start;
    loop {
        let records = app
            .services()
            .event_store
            .read_stream(&stream, Direction::Forwards, from, 500)
            .await
            .unwrap();
        let Some(last) = records.last() else { break };
        from = ReadFrom::Version(last.stream_version + 1);
        for record in &records {
            match zhihui_domain::DomainEvent::from_stored(
                &record.event_type,
                record.schema_version,
                &record.payload,
            )
            .unwrap()
            {
                BatchEvent::Created(created) => first = Some(created.first_serial),
                BatchEvent::Issued(page) => pages.push((page.from_serial, page.count)),
                BatchEvent::Revoked(_) => panic!("nobody revoked it"),
            }
        }
    }
    (first.unwrap(), pages)
}

/// A process issues a batch of 100,000 codes in seconds from its 202; a generator
/// killed with SIGKILL mid-batch is resumed by another process, without a serial issued twice or
/// skipped.
#[tokio::test]
async fn a_code_generator_killed_mid_batch_is_resumed_by_another_process() {
    let app = spawn_app().await;
    let images = std::env::temp_dir().join(format!("zhihui-processes-{}", Uuid::now_v7()));
    // No ComfyUI here. Pages of 20: a batch of 100,000 takes 5,000 appends, long enough to be
    // killed in the middle of it.
    let small_pages = [
        ("ZHIHUI_DISPATCH__ENABLED", "false"),
        ("ZHIHUI_CODES__PAGE_SIZE", "20"),
        ("ZHIHUI_CODES__ISSUE_SCAN_INTERVAL_MS", "200"),
    ];
    let unused = "gpu-0 http://127.0.0.1:9 1";
    let mut dying = serve_with(&app, unused, &images, &small_pages).await;
    let http = reqwest::Client::new();
    app.admin_token("boss").await;
    let admin = login_via(&http, &dying.address, "boss", "admin password").await;
    let batch = create_batch_via(&http, &dying.address, &admin, 100_000).await;
    let started = tokio::time::Instant::now();
    loop {
        let (_, issued) = batch_progress(&http, &dying.address, &admin, &batch).await;
        if issued >= 1_000 {
            assert!(issued < 100_000, "the batch was issued before the kill");
            break;
        }
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "the generator never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    dying.child.start_kill().unwrap();
    dying.child.wait().await.unwrap();
    let (first, before) = issued_pages(&app, &batch).await;
    let issued_before: u32 = before.iter().map(|(_, count)| count).sum();
    assert!(
        (1_000..100_000).contains(&issued_before),
        "killed mid-batch: {issued_before} issued"
    );

    // Another process (the default page size) finds the batch unfinished and finishes it.
    let other = serve_with(&app, unused, &images, &small_pages[..1]).await;
    let started = tokio::time::Instant::now();
    while batch_progress(&http, &other.address, &admin, &batch)
        .await
        .0
        != "issued"
    {
        assert!(started.elapsed() < WAIT_LIMIT, "nobody resumed the batch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, pages) = issued_pages(&app, &batch).await;
    assert_eq!(&pages[..before.len()], &before[..]);
    let mut next = first;
    for (from, count) in &pages {
        assert_eq!(*from, next, "pages are contiguous: {pages:?}");
        next += count;
    }
    assert_eq!(next, first + 100_000);

    // A whole batch of 100,000 at the default page size, from the 202 to the last page.
    let started = tokio::time::Instant::now();
    let timed = create_batch_via(&http, &other.address, &admin, 100_000).await;
    while batch_progress(&http, &other.address, &admin, &timed)
        .await
        .0
        != "issued"
    {
        assert!(started.elapsed() < WAIT_LIMIT, "the batch was never issued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    // BENCHMARKS.md quotes this figure; `--no-capture` shows it.
    #[allow(clippy::print_stdout)]
    {
        println!(
            "100,000 codes issued {seconds:.2} s after the request; killed after {issued_before}, resumed"
        );
    }
    let (timed_first, timed_pages) = issued_pages(&app, &timed).await;
    assert_eq!(timed_first, first + 100_000, "serials never reused");
    assert_eq!(timed_pages.iter().map(|(_, c)| c).sum::<u32>(), 100_000);

    // The read model holds every code of both batches once.
    let client = crate::helpers::connect(&app.settings).await;
    let started = tokio::time::Instant::now();
    loop {
        let row = client
            .query_one(
                "SELECT count(*), count(DISTINCT serial) FROM redeem_codes",
                &[],
            )
            .await
            .unwrap();
        let (rows, distinct) = (row.get::<_, i64>(0), row.get::<_, i64>(1));
        assert_eq!(rows, distinct);
        if rows == 200_000 {
            break;
        }
        assert!(started.elapsed() < WAIT_LIMIT, "{rows} codes projected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(other);
    let _ = std::fs::remove_dir_all(&images);
}

/// 50 check-ins of one user at once, alternating between two `zhihui serve` processes:
/// one bonus, one check-in event.
#[tokio::test]
async fn fifty_check_ins_of_one_user_through_two_processes_credit_one_bonus() {
    let app = spawn_app().await;
    let images = std::env::temp_dir().join(format!("zhihui-processes-{}", Uuid::now_v7()));
    let settings = [("ZHIHUI_DISPATCH__ENABLED", "false")];
    let unused = "gpu-0 http://127.0.0.1:9 1";
    let first = serve_with(&app, unused, &images, &settings).await;
    let second = serve_with(&app, unused, &images, &settings).await;
    let http = reqwest::Client::new();
    let registered: Value = http
        .post(format!("{}/api/v1/auth/register", first.address))
        .json(&json!({"username": "daily", "password": "correct horse battery"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let user_id = Uuid::parse_str(registered["id"].as_str().unwrap()).unwrap();
    let token = login_via(&http, &second.address, "daily", "correct horse battery").await;
    let answers = futures::future::join_all((0..50).map(|index| {
        let address = if index % 2 == 0 {
            &first.address
        } else {
            &second.address
        };
        let request = http
            .post(format!("{address}/api/v1/checkins"))
            .bearer_auth(&token)
            .send();
        async move {
            let response = request.await.unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    }))
    .await;
    let now = answers
        .iter()
        .filter(|answer| answer["checked_in_now"] == true)
        .count();
    assert_eq!(now, 1, "{answers:?}");
    assert!(answers.iter().all(|answer| answer["streak"] == 1));
    let user = zhihui_domain::user::UserId::from_uuid(user_id);
    let credits = account_events(&app, user)
        .await
        .into_iter()
        .filter(|event| {
            matches!(event, zhihui_domain::account::AccountEvent::Credited(credit)
                if credit.kind == zhihui_domain::account::CreditKind::CheckInBonus)
        })
        .count();
    assert_eq!(credits, 1);
    drop((first, second));
    let _ = std::fs::remove_dir_all(&images);
}

async fn account_events(
    app: &TestApp,
    user: zhihui_domain::user::UserId,
) -> Vec<zhihui_domain::account::AccountEvent> {
    use zhihui::platform::event_store::{Direction, EventStore, ReadFrom};
    app.services()
        .event_store
        .read_stream(
            &zhihui_domain::account::account_stream(user),
            Direction::Forwards,
            ReadFrom::Start,
            1_000,
        )
        .await
        .unwrap()
        .iter()
        .map(|record| {
            zhihui_domain::DomainEvent::from_stored(
                &record.event_type,
                record.schema_version,
                &record.payload,
            )
            .unwrap()
        })
        .collect()
}

/// The access log writes request lines with the secrets of their query redacted: a
/// bearer token sent as `?token=` (as a browser's socket does), a cursor, a one-time code.
#[tokio::test]
async fn the_access_log_never_shows_a_token_sent_in_the_query() {
    use tokio::io::AsyncReadExt;
    let app = spawn_app().await;
    let images = std::env::temp_dir().join(format!("zhihui-processes-{}", Uuid::now_v7()));
    let settings = [
        ("ZHIHUI_DISPATCH__ENABLED", "false"),
        ("ZHIHUI_LOG__FILTER", "warn,zhihui::http=info"),
        ("ZHIHUI_LOG__FORMAT", "json"),
    ];
    let mut logged =
        serve_capturing(&app, "gpu-0 http://127.0.0.1:9 1", &images, &settings, true).await;
    let http = reqwest::Client::new();
    app.admin_token("boss").await;
    let token = login_via(&http, &logged.address, "boss", "admin password").await;
    let secret_cursor = "1234567_00000000-0000-0000-0000-00000000beef";
    for path in [
        format!("/api/v1/ws?token={token}"),
        format!("/api/v1/tasks?limit=2&cursor={secret_cursor}"),
        "/api/v1/ws?Token=wrong-but-secret&code=987654".to_owned(),
    ] {
        http.get(format!("{}{path}", logged.address))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
    }
    logged.child.start_kill().unwrap();
    logged.child.wait().await.unwrap();
    let mut output = String::new();
    logged
        .child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut output)
        .await
        .unwrap();
    logged
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut output)
        .await
        .unwrap();
    assert!(
        output.contains("GET /api/v1/ws?token=REDACTED"),
        "the request is logged: {output}"
    );
    assert!(output.contains("limit=2&cursor=REDACTED"), "{output}");
    for secret in [token.as_str(), secret_cursor, "wrong-but-secret", "987654"] {
        assert!(!output.contains(secret), "{secret} in the log: {output}");
    }
    let _ = std::fs::remove_dir_all(&images);
}

/// The process consuming the claims stream is SIGKILLed while it holds an entry it has
/// not acknowledged; another process takes it over after `promotions.takeover_idle_ms` and every
/// accepted claim is granted exactly once.
#[tokio::test]
async fn a_claims_consumer_killed_mid_stream_is_taken_over_and_no_claim_is_lost() {
    const CLAIMS: usize = 500;
    let app = spawn_app().await;
    let images = std::env::temp_dir().join(format!("zhihui-processes-{}", Uuid::now_v7()));
    let unused = "gpu-0 http://127.0.0.1:9 1";
    let services = app.services();
    let admin = app.admin_token("boss").await;
    let now = app.clock.now();
    let created: Value = app
        .post(
            "/api/v1/admin/promotions",
            Some(&admin),
            &json!({
                "title": "Pack", "points": "10", "price": "0", "stock": CLAIMS,
                "starts_at": chrono::Utc::now() - chrono::Duration::hours(1),
                "ends_at": std::cmp::max(now, chrono::Utc::now()) + chrono::Duration::days(400),
            }),
        )
        .await
        .json()
        .await
        .unwrap();
    let promotion = Uuid::parse_str(created["promotion_id"].as_str().unwrap()).unwrap();

    // One process consumes, one claim at a time, so it always holds the entry it works on.
    let mut dying = serve_with(
        &app,
        unused,
        &images,
        &[
            ("ZHIHUI_DISPATCH__ENABLED", "false"),
            ("ZHIHUI_PROMOTIONS__CONSUMER_BATCH", "1"),
            ("ZHIHUI_PROMOTIONS__TAKEOVER_IDLE_MS", "1000"),
        ],
    )
    .await;
    // The gate (here in the test's process, as a third instance would) accepts every claim.
    for _ in 0..CLAIMS {
        let user = zhihui_domain::user::UserId::from_uuid(Uuid::now_v7());
        services.promotions.claim(user, promotion).await.unwrap();
    }
    let mut redis = services.redis.connection().await.unwrap();
    let stream = services.promotions.stream_key();
    let pid = dying.child.id().unwrap().to_string();
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([name, &pid])
            .status()
            .unwrap();
        assert!(status.success());
    };
    let started = tokio::time::Instant::now();
    // Freeze the consumer; kill it only while it holds an entry it has not acknowledged.
    loop {
        signal("-STOP");
        let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("persist")
            .query_async(&mut redis)
            .await
            .unwrap();
        if pending.count() > 0 {
            break;
        }
        signal("-CONT");
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "the consumer never held a claim"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    dying.child.start_kill().unwrap();
    dying.child.wait().await.unwrap();
    let killed_at = tokio::time::Instant::now();

    let _taking_over = serve_with(
        &app,
        unused,
        &images,
        &[
            ("ZHIHUI_DISPATCH__ENABLED", "false"),
            ("ZHIHUI_PROMOTIONS__TAKEOVER_IDLE_MS", "1000"),
        ],
    )
    .await;
    let client = crate::helpers::connect(&app.settings).await;
    loop {
        let granted: i64 = client
            .query_one(
                "SELECT count(*) FROM promotion_claims
                  WHERE promotion_id = $1 AND status = 'granted' AND credited_at IS NOT NULL",
                &[&promotion],
            )
            .await
            .unwrap()
            .get(0);
        // Every claim granted and credited, and every entry acknowledged (the dead consumer's
        // too, once taken over).
        let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("persist")
            .query_async(&mut redis)
            .await
            .unwrap();
        if granted == i64::try_from(CLAIMS).unwrap() && pending.count() == 0 {
            break;
        }
        assert!(
            killed_at.elapsed() < WAIT_LIMIT,
            "{granted} of {CLAIMS} granted, {} pending",
            pending.count()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let distinct: i64 = client
        .query_one(
            "SELECT count(DISTINCT user_id) FROM promotion_claims WHERE promotion_id = $1",
            &[&promotion],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(distinct, i64::try_from(CLAIMS).unwrap());
    crate::tasks::project_and_verify(&app).await;
    let _ = std::fs::remove_dir_all(&images);
}

/// The pool at run time across two `zhihui serve` processes: through the follower an admin drains
/// one server and adds a third; the leader follows; SIGKILLed mid-run, the follower takes over
/// with the same pool (the drained server stays drained, the added one is used), every task ends
/// once on a server in service, and the audit finds no difference.
#[tokio::test]
async fn a_pool_changed_through_one_process_survives_its_leaders_sigkill() {
    let app = spawn_app().await;
    let directory = std::env::temp_dir().join(format!("zhihui-pool-kill-{}", Uuid::now_v7()));
    let sims = slow_sims(&directory, 3).await;
    let backends = format!(
        "gpu-0 {} 1,gpu-1 {} 1",
        sims[0].base_url(),
        sims[1].base_url()
    );
    let images = directory.join("images");
    let prefix = app.settings.redis.key_prefix.clone();
    let mut redis = crate::helpers::redis_of(&app.settings).await;
    let fast_status = [("ZHIHUI_DISPATCH__STATUS_PUBLISH_INTERVAL_MS", "100")];
    let mut leading = serve_with(&app, &backends, &images, &fast_status).await;
    let first_leader = wait_for_leader(&mut redis, &prefix, None).await;
    let other = serve_with(&app, &backends, &images, &fast_status).await;
    let http = reqwest::Client::new();
    let admin = app.admin_token("pool-boss").await;
    let (_, token) = funded_user_via(&app, &http, &other.address, "pool-painter", "20").await;
    let backends_on = |address: &str| {
        let request = http
            .get(format!("{address}/api/v1/admin/backends"))
            .bearer_auth(&admin)
            .send();
        async move {
            let list: Vec<Value> = request.await.unwrap().json().await.unwrap();
            list.into_iter()
                .map(|item| (item["name"].as_str().unwrap().to_owned(), item))
                .collect::<HashMap<String, Value>>()
        }
    };
    let wait_for_states = |address: String, wanted: Vec<(&'static str, &'static str)>| {
        let backends_on = &backends_on;
        async move {
            let started = tokio::time::Instant::now();
            loop {
                let list = backends_on(&address).await;
                if wanted.iter().all(|(name, state)| {
                    list.get(*name).is_some_and(|item| item["state"] == *state)
                }) {
                    return list;
                }
                assert!(started.elapsed() < WAIT_LIMIT, "never {wanted:?}: {list:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    // Through the follower: drain gpu-1, add gpu-2. The leader follows.
    let drained = http
        .post(format!(
            "{}/api/v1/admin/backends/gpu-1/drain",
            other.address
        ))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(drained.status(), 200);
    let added = http
        .post(format!("{}/api/v1/admin/backends", other.address))
        .bearer_auth(&admin)
        .json(&json!({"name": "gpu-2", "url": sims[2].base_url()}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), 201);
    wait_for_states(
        leading.address.clone(),
        vec![("gpu-0", "up"), ("gpu-1", "drained"), ("gpu-2", "up")],
    )
    .await;

    let mut tasks = Vec::new();
    for _ in 0..6 {
        let submitted = http
            .post(format!("{}/api/v1/tasks", other.address))
            .bearer_auth(&token)
            .json(&json!({"prompt": "a harbour", "images": 1, "steps": 20}))
            .send()
            .await
            .unwrap();
        assert_eq!(submitted.status(), 201);
        let submitted: Value = submitted.json().await.unwrap();
        tasks.push(submitted["task_id"].as_str().unwrap().to_owned());
    }
    // Killed once a task runs.
    let status_of = |task: String| {
        let request = http
            .get(format!("{}/api/v1/tasks/{task}", other.address))
            .bearer_auth(&token)
            .send();
        async move {
            let view: Value = request.await.unwrap().json().await.unwrap();
            view["status"].as_str().unwrap().to_owned()
        }
    };
    let started = tokio::time::Instant::now();
    while status_of(tasks[0].clone()).await != "running" {
        assert!(started.elapsed() < WAIT_LIMIT, "the first task never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    leading.child.start_kill().unwrap();
    leading.child.wait().await.unwrap();
    wait_for_leader(&mut redis, &prefix, Some(&first_leader)).await;

    // The successor follows the same pool.
    let list = wait_for_states(
        other.address.clone(),
        vec![("gpu-0", "up"), ("gpu-1", "drained"), ("gpu-2", "up")],
    )
    .await;
    assert_eq!(list.len(), 3);
    let started = tokio::time::Instant::now();
    for task in &tasks {
        while status_of(task.clone()).await != "succeeded" {
            assert!(started.elapsed() < WAIT_LIMIT, "{task} never succeeded");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut used = HashSet::new();
    for task in &tasks {
        let events = task_events(&app, task).await;
        let ends = events
            .iter()
            .filter(|e| matches!(e, TaskEvent::Succeeded(_) | TaskEvent::Failed(_)))
            .count();
        assert_eq!(ends, 1, "{events:?}");
        for event in &events {
            if let TaskEvent::Dispatched(dispatched) = event {
                assert_ne!(dispatched.backend, "gpu-1", "a drained server got a task");
                used.insert(dispatched.backend.clone());
            }
        }
    }
    assert!(
        used.contains("gpu-2"),
        "the added server took no task: {used:?}"
    );
    drop(other);
    project_and_verify(&app).await;
    for sim in sims {
        sim.stop().await;
    }
    drop(std::fs::remove_dir_all(&directory));
}
