//! A PostgreSQL primary that dies: a primary with a streaming standby started
//! by `scripts/services.sh start-pg-pair`, two `zhihui serve` processes on its multi-host URL
//! (`target_session_attrs=read-write`), grants, tasks, their prioritises and check-ins sent through
//! both in turn while the
//! primary is killed with SIGKILL and the standby promoted. Both processes answer again without a
//! restart; every grant a client was told succeeded is in the log exactly once; every task a
//! client was told was accepted ends once; `zhihui audit verify` passes on the new primary.
//!
//! With a synchronous standby nothing acknowledged may be lost; without one, the test counts what
//! was (the README says how much can be) and still asks that nothing landed twice.
//!
//! The same load through an operator's restart of the primary (a fast shutdown, down a second,
//! started again; the standby stays a standby): every answer meanwhile is a 503 with
//! `Retry-After`, never a 500, and nothing acknowledged is lost.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use comfyui_sim::{Faults, SimConfig, Simulator};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio::time::Instant;
use uuid::Uuid;

use crate::helpers::{free_port, spawn_app_at};
use crate::processes::serve_capturing;

/// Longest any one wait may take (a hang, not a slow machine).
const WAIT_LIMIT: Duration = Duration::from_secs(90);
/// The primary dies this long after the load starts; the standby is promoted this long after.
const KILL_AFTER: Duration = Duration::from_secs(2);
const PROMOTE_AFTER: Duration = Duration::from_secs(1);
/// After the promotion the load goes on this long (each process must have answered by then).
const LOAD_AFTER_PROMOTION: Duration = Duration::from_secs(4);

/// What happens to the primary while the load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disaster {
    /// SIGKILL, then the standby promoted.
    KilledAndStandbyPromoted,
    /// A fast shutdown, down for `DOWN_FOR`, then started again as it was.
    Restarted,
}

/// How long a restarted primary stays down.
const DOWN_FOR: Duration = Duration::from_secs(1);

/// A primary and its streaming standby, on their own ports and directory.
struct Pair {
    directory: std::path::PathBuf,
    primary_port: u16,
    standby_port: u16,
    synchronous: bool,
}

impl Pair {
    fn services(&self, command: &str) -> std::process::Output {
        let output = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services.sh"))
            .arg(command)
            .env("ZHIHUI_LOCAL_DIR", &self.directory)
            .env("ZHIHUI_PG_PRIMARY_PORT", self.primary_port.to_string())
            .env("ZHIHUI_PG_STANDBY_PORT", self.standby_port.to_string())
            .env(
                "ZHIHUI_PG_SYNCHRONOUS",
                if self.synchronous { "1" } else { "0" },
            )
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "services.sh {command}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }

    fn start(synchronous: bool) -> Pair {
        let pair = Pair {
            directory: std::env::temp_dir().join(format!("zhihui-pg-pair-{}", Uuid::now_v7())),
            primary_port: free_port(),
            standby_port: free_port(),
            synchronous,
        };
        let output = pair.services("start-pg-pair");
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(printed.contains(&pair.url()), "{printed}");
        pair
    }

    fn url(&self) -> String {
        format!(
            "postgres://zhihui@127.0.0.1:{},127.0.0.1:{}/zhihui?target_session_attrs=read-write",
            self.primary_port, self.standby_port
        )
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/services.sh"))
            .arg("stop-pg-pair")
            .env("ZHIHUI_LOCAL_DIR", &self.directory)
            .output();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// What the clients were told.
#[derive(Default)]
struct Told {
    /// Grants answered 201: their operation ids.
    grants: Vec<String>,
    /// Grants whose answer was an error or never came: their reasons (they may have landed).
    grants_unanswered: Vec<String>,
    /// Tasks answered 201: (owner's token, task id).
    tasks: Vec<(String, String)>,
    /// Per process: from the primary's kill to the end of the first round started after it
    /// that succeeded.
    back_after_kill: HashMap<String, Duration>,
    answered: usize,
    failed: usize,
    /// Every answer by status (grants, tasks, prioritises, check-ins), and the requests that got
    /// no answer.
    by_status: std::collections::BTreeMap<u16, usize>,
    /// 503s that did not say when to come back.
    unavailable_without_retry_after: usize,
    no_answer: usize,
}

impl Told {
    fn count(&mut self, answer: &Result<reqwest::Response, reqwest::Error>) {
        match answer {
            Ok(response) => {
                *self
                    .by_status
                    .entry(response.status().as_u16())
                    .or_default() += 1;
                if response.status() == 503 && !response.headers().contains_key("retry-after") {
                    self.unavailable_without_retry_after += 1;
                }
            }
            Err(_) => self.no_answer += 1,
        }
    }
}

/// What the log holds of what the clients were told.
struct Found {
    /// Acknowledged grants not in the log.
    lost_grants: Vec<String>,
    /// Accepted tasks not in the log.
    lost_tasks: Vec<String>,
    /// Unanswered grants that landed anyway (once each).
    landed_unanswered: usize,
}

async fn failover_drill(synchronous: bool, disaster: Disaster) -> (Told, Found) {
    let pair = Pair::start(synchronous);
    let app = spawn_app_at(&pair.url(), |_| {}).await;
    let directory = std::env::temp_dir().join(format!("zhihui-failover-{}", Uuid::now_v7()));
    let sim = Simulator::start(SimConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        output_dir: directory.join("sim"),
        models: vec!["majicmixRealistic_v7.safetensors".into()],
        faults: Faults {
            step_delay_ms: 5,
            ..Faults::default()
        },
    })
    .await
    .unwrap();
    let backends = format!("gpu-0 {} 4", sim.base_url());
    let images = directory.join("images");
    let processes = [
        serve_capturing(&app, &backends, &images, &[], false).await,
        serve_capturing(&app, &backends, &images, &[], false).await,
    ];
    let addresses: Vec<String> = processes.iter().map(|p| p.address.clone()).collect();

    let admin = app.admin_token("drill_admin").await;
    let mut users = Vec::new();
    for index in 0..3 {
        let name = format!("drill_user{index}");
        let id = app.register(&name, "a long enough password").await;
        let token = app.login(&name, "a long enough password").await;
        let granted = app
            .post(
                &format!("/api/v1/admin/accounts/{id}/grants"),
                Some(&admin),
                &json!({"amount": "1000", "reason": "演练前的积分"}),
            )
            .await;
        assert_eq!(granted.status(), 201);
        users.push((id, token));
    }

    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(45))
        .build()
        .unwrap();
    let told = Arc::new(Mutex::new(Told::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let mut clients = Vec::new();
    for (client, (user_id, token)) in users.iter().cloned().enumerate() {
        let (http, told, stop, killed_at, addresses, admin) = (
            http.clone(),
            told.clone(),
            stop.clone(),
            killed_at.clone(),
            addresses.clone(),
            admin.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut turn = client;
            while !stop.load(Ordering::Relaxed) {
                // One request through each process in turn, a grant then a task.
                let address = &addresses[turn % addresses.len()];
                turn += 1;
                let round_started = Instant::now();
                let reason = format!("故障切换演练 客户{client} 第{turn}次");
                let grant = http
                    .post(format!("{address}/api/v1/admin/accounts/{user_id}/grants"))
                    .bearer_auth(&admin)
                    .json(&json!({"amount": "1", "reason": reason}))
                    .send()
                    .await;
                told.lock().await.count(&grant);
                let grant_ok = match grant {
                    Ok(response) if response.status() == 201 => {
                        let body: Value = response.json().await.unwrap();
                        told.lock()
                            .await
                            .grants
                            .push(body["operation_id"].as_str().unwrap().to_owned());
                        true
                    }
                    _ => {
                        told.lock().await.grants_unanswered.push(reason);
                        false
                    }
                };
                let task = http
                    .post(format!("{address}/api/v1/tasks"))
                    .bearer_auth(&token)
                    .json(&json!({"prompt": "一只在雪地里奔跑的红狐狸", "steps": 4}))
                    .send()
                    .await;
                told.lock().await.count(&task);
                let mut accepted = None;
                let task_ok = match task {
                    Ok(response) if response.status() == 201 => {
                        let body: Value = response.json().await.unwrap();
                        let task_id = body["task_id"].as_str().unwrap().to_owned();
                        told.lock()
                            .await
                            .tasks
                            .push((token.clone(), task_id.clone()));
                        accepted = Some(task_id);
                        true
                    }
                    // Too many queued is an answer, not a failure of the store.
                    Ok(response) if response.status() == 429 || response.status() == 409 => true,
                    _ => false,
                };
                // The other paths that move points, through the same process: the fee of a
                // prioritise (moved, or refused once the task left the queue) and the day's
                // check-in (its bonus once, then "already"). Each answer counted: never a 500.
                if let Some(task_id) = accepted {
                    let prioritised = http
                        .post(format!("{address}/api/v1/tasks/{task_id}/prioritise"))
                        .bearer_auth(&token)
                        .send()
                        .await;
                    told.lock().await.count(&prioritised);
                }
                let checked_in = http
                    .post(format!("{address}/api/v1/checkins"))
                    .bearer_auth(&token)
                    .send()
                    .await;
                told.lock().await.count(&checked_in);
                let mut told = told.lock().await;
                if grant_ok && task_ok {
                    told.answered += 1;
                    if let Some(killed) = *killed_at.lock().await
                        && round_started > killed
                    {
                        told.back_after_kill
                            .entry(address.clone())
                            .or_insert_with(|| killed.elapsed());
                    }
                } else {
                    told.failed += 1;
                }
                drop(told);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    tokio::time::sleep(KILL_AFTER).await;
    let answered_before = told.lock().await.answered;
    assert!(answered_before > 0, "no request succeeded before the kill");
    match disaster {
        Disaster::KilledAndStandbyPromoted => {
            pair.services("kill-primary");
            *killed_at.lock().await = Some(Instant::now());
            tokio::time::sleep(PROMOTE_AFTER).await;
            pair.services("promote-standby");
        }
        Disaster::Restarted => {
            *killed_at.lock().await = Some(Instant::now());
            pair.services("stop-primary");
            tokio::time::sleep(DOWN_FOR).await;
            pair.services("restart-old-primary");
        }
    }
    let promoted_at = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let back = told.lock().await.back_after_kill.len();
        if back == addresses.len() && promoted_at.elapsed() >= LOAD_AFTER_PROMOTION {
            break;
        }
        assert!(
            promoted_at.elapsed() < WAIT_LIMIT,
            "a process never answered after the failover"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.unwrap();
    }
    let told = Arc::try_unwrap(told).ok().unwrap().into_inner();

    // Every task a client was told was accepted ends, once (or, with an asynchronous standby,
    // was lost with the primary: then it is nowhere).
    let started = Instant::now();
    let mut lost_tasks = Vec::new();
    for (token, task_id) in &told.tasks {
        loop {
            let response = http
                .get(format!("{}/api/v1/tasks/{task_id}", addresses[0]))
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            if response.status() == 404 {
                lost_tasks.push(task_id.clone());
                break;
            }
            let view: Value = response.json().await.unwrap();
            if ["succeeded", "failed", "cancelled"].contains(&view["status"].as_str().unwrap()) {
                break;
            }
            assert!(
                started.elapsed() < WAIT_LIMIT,
                "task {task_id} never ended: {view}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let client = crate::helpers::connect(&app.settings).await;
    let at: (i32, bool) = {
        let row = client
            .query_one("SELECT inet_server_port(), pg_is_in_recovery()", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    let read_write = match disaster {
        Disaster::KilledAndStandbyPromoted => pair.standby_port,
        Disaster::Restarted => pair.primary_port,
    };
    assert_eq!(
        at,
        (i32::from(read_write), false),
        "the app's URL finds the read-write server"
    );
    for (_, task_id) in told.tasks.iter().filter(|(_, id)| !lost_tasks.contains(id)) {
        let ends: i64 = client
            .query_one(
                "SELECT count(*) FROM events WHERE stream_id = 'task-' || $1 \
                   AND event_type IN ('TaskSucceeded', 'TaskFailed', 'TaskCancelled')",
                &[task_id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(ends, 1, "task {task_id} ended {ends} times");
    }
    // Every acknowledged grant, counted in the log.
    let mut lost_grants = Vec::new();
    for operation_id in &told.grants {
        let found: i64 = client
            .query_one(
                "SELECT count(*) FROM events WHERE event_type = 'PointsGranted' \
                   AND payload->>'operation_id' = $1",
                &[operation_id],
            )
            .await
            .unwrap()
            .get(0);
        assert!(found <= 1, "grant {operation_id} landed {found} times");
        if found == 0 {
            lost_grants.push(operation_id.clone());
        }
    }
    let unique: HashSet<&String> = told.grants.iter().collect();
    assert_eq!(unique.len(), told.grants.len());
    let mut landed_unanswered = 0;
    for reason in &told.grants_unanswered {
        let found: i64 = client
            .query_one(
                "SELECT count(*) FROM events WHERE event_type = 'PointsGranted' \
                   AND payload->>'reason' = $1",
                &[reason],
            )
            .await
            .unwrap()
            .get(0);
        assert!(found <= 1, "grant {reason:?} landed {found} times");
        landed_unanswered += usize::try_from(found).unwrap();
    }
    // Both processes' leaders followed the new primary: the projections caught up, and the
    // audit finds every balance equal to its events.
    crate::tasks::project_and_verify(&app).await;
    drop(processes);
    drop(sim);
    let _ = std::fs::remove_dir_all(&directory);
    drop(pair);
    (
        told,
        Found {
            lost_grants,
            lost_tasks,
            landed_unanswered,
        },
    )
}

#[allow(clippy::print_stdout)] // the figures of the closing note (`--no-capture`)
fn report(title: &str, told: &Told, found: &Found) {
    let mut back: Vec<String> = told
        .back_after_kill
        .iter()
        .map(|(address, after)| format!("{address} after {} ms", after.as_millis()))
        .collect();
    back.sort();
    println!(
        "{title}: {} grants acknowledged, {} lost; {} unanswered ({} of them landed); {} tasks accepted, {} lost, the others ended once; rounds answered {}, failed {}; answers by status {:?} ({} 503s without Retry-After), {} with no answer; first success after the disaster: {}",
        told.grants.len(),
        found.lost_grants.len(),
        told.grants_unanswered.len(),
        found.landed_unanswered,
        told.tasks.len(),
        found.lost_tasks.len(),
        told.answered,
        told.failed,
        told.by_status,
        told.unavailable_without_retry_after,
        told.no_answer,
        back.join(", ")
    );
}

#[tokio::test]
async fn with_a_synchronous_standby_a_killed_primary_loses_no_acknowledged_append() {
    let (told, found) = Box::pin(failover_drill(true, Disaster::KilledAndStandbyPromoted)).await;
    report("synchronous standby", &told, &found);
    // A store failing over is a 503 with Retry-After, never a 500 (a 500 means a bug).
    assert!(!told.by_status.contains_key(&500), "{:?}", told.by_status);
    assert!(
        found.lost_grants.is_empty() && found.lost_tasks.is_empty(),
        "acknowledged appends lost: grants {:?}, tasks {:?}",
        found.lost_grants,
        found.lost_tasks
    );
    assert!(told.grants.len() > 10, "{} grants", told.grants.len());
    assert!(!told.tasks.is_empty());
}

#[tokio::test]
async fn with_an_asynchronous_standby_a_killed_primary_is_survived_and_nothing_lands_twice() {
    let (told, found) = Box::pin(failover_drill(false, Disaster::KilledAndStandbyPromoted)).await;
    // Asynchronous replication may lose the last acknowledged commits (README: at most what
    // the standby had not received, typically the last milliseconds): counted, not forbidden.
    report("asynchronous standby", &told, &found);
    assert!(!told.by_status.contains_key(&500), "{:?}", told.by_status);
    assert!(told.grants.len() > 10, "{} grants", told.grants.len());
}

/// The events a server holds that a grant with `reason` appended.
async fn grants_with_reason(client: &tokio_postgres::Client, reason: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM events WHERE event_type = 'PointsGranted' \
               AND payload->>'reason' = $1",
            &[&reason],
        )
        .await
        .unwrap()
        .get(0)
}

/// A connection to one server of the pair (not through the app's multi-host URL).
async fn server(port: u16) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(
        &format!("postgres://zhihui@127.0.0.1:{port}/zhihui"),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    client
}

/// After a failover the old primary is started again by mistake, as it was: a second
/// read-write server, listed first in the URL, on the old timeline. zhihui fences it: the
/// process that lived through the failover, a second instance with new pools, and a new `zhihui
/// serve` process that saw nothing of the failover all write on the new primary, and the old one
/// receives no append. Then the way back (`services.sh rejoin-old-primary`: pg_rewind, start as
/// the new primary's standby): it streams everything it missed.
#[tokio::test]
async fn an_old_primary_started_again_takes_no_append_and_rejoins_as_a_standby() {
    // Asynchronous: a restarted old primary has no synchronous standby to wait for, so a write
    // sent to it would land at once (the split brain to prevent, not hidden by a wait).
    let pair = Pair::start(false);
    let app = spawn_app_at(&pair.url(), |_| {}).await;
    let admin = app.admin_token("fence_admin").await;
    let user = app.register("fence_user", "a long enough password").await;
    let http = reqwest::Client::new();
    // A grant through `address`, retried while the store is away (503); its final status.
    let grant = |address: String, reason: String| {
        let (http, admin, user) = (http.clone(), admin.clone(), user.clone());
        async move {
            let started = Instant::now();
            loop {
                let response = http
                    .post(format!("{address}/api/v1/admin/accounts/{user}/grants"))
                    .bearer_auth(&admin)
                    .json(&json!({"amount": "1", "reason": reason}))
                    .send()
                    .await;
                match response {
                    Ok(response) if response.status() != 503 => {
                        return response.status().as_u16();
                    }
                    _ => {
                        assert!(
                            started.elapsed() < WAIT_LIMIT,
                            "{reason}: still unavailable"
                        );
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    };
    assert_eq!(grant(app.address.clone(), "围栏 切换前".into()).await, 201);

    pair.services("kill-primary");
    pair.services("promote-standby");
    // The process writes on the new primary (its pool found the new timeline).
    assert_eq!(grant(app.address.clone(), "围栏 切换后".into()).await, 201);

    pair.services("restart-old-primary");
    let old = server(pair.primary_port).await;
    let old_state: (bool, i64) = {
        let row = old
            .query_one(
                "SELECT pg_is_in_recovery(), (SELECT count(*) FROM events)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert!(
        !old_state.0,
        "the old primary is read-write again: the mistake to survive"
    );

    let second = app.another_instance().await;
    let (directory, sim) = crate::metrics::one_model_sim().await;
    let fresh = serve_capturing(
        &app,
        &format!("gpu-0 {} 1", sim.base_url()),
        &directory.join("images"),
        &[],
        false,
    )
    .await;
    let mut reasons = Vec::new();
    for (who, address) in [
        ("同一进程", app.address.clone()),
        ("第二实例", second.address.clone()),
        ("新进程", fresh.address.clone()),
    ] {
        for n in 0..5 {
            let reason = format!("围栏 {who} 第{n}次");
            assert_eq!(
                grant(address.clone(), reason.clone()).await,
                201,
                "{reason}"
            );
            reasons.push(reason);
        }
    }
    // Nothing landed on the old primary; everything on the new one, once.
    let old_events: i64 = old
        .query_one("SELECT count(*) FROM events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        old_events, old_state.1,
        "the fenced old primary took appends"
    );
    let new = server(pair.standby_port).await;
    for reason in &reasons {
        assert_eq!(grants_with_reason(&old, reason).await, 0, "{reason}");
        assert_eq!(grants_with_reason(&new, reason).await, 1, "{reason}");
    }
    drop(old);

    // The way back: rewound from the new primary, it follows it as a standby.
    pair.services("rejoin-old-primary");
    let rejoined = server(pair.primary_port).await;
    let in_recovery: bool = rejoined
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(in_recovery, "the old primary came back as a standby");
    let started = Instant::now();
    while grants_with_reason(&rejoined, reasons.last().unwrap()).await != 1 {
        assert!(
            started.elapsed() < WAIT_LIMIT,
            "the rejoined standby never caught up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // One more grant after the rejoin: on the new primary, streamed to the old one.
    assert_eq!(
        grant(fresh.address.clone(), "围栏 归队后".into()).await,
        201
    );
    crate::tasks::project_and_verify(&app).await;
    drop(fresh);
    drop(sim);
    let _ = std::fs::remove_dir_all(&directory);
}

#[tokio::test]
async fn a_primary_restarted_by_an_operator_is_a_503_with_retry_after_meanwhile_and_loses_nothing()
{
    let (told, found) = Box::pin(failover_drill(false, Disaster::Restarted)).await;
    report("primary restarted", &told, &found);
    let errors: Vec<u16> = told
        .by_status
        .keys()
        .copied()
        .filter(|status| *status >= 500)
        .collect();
    assert!(
        errors.iter().all(|status| *status == 503),
        "{:?}",
        told.by_status
    );
    assert!(
        errors.contains(&503),
        "nothing met the server while it was down: {:?}",
        told.by_status
    );
    assert_eq!(told.unavailable_without_retry_after, 0);
    // A fast shutdown flushes what was committed: nothing acknowledged is lost.
    assert!(
        found.lost_grants.is_empty() && found.lost_tasks.is_empty(),
        "acknowledged appends lost: grants {:?}, tasks {:?}",
        found.lost_grants,
        found.lost_tasks
    );
    assert!(told.grants.len() > 10, "{} grants", told.grants.len());
}

/// A loopback TCP proxy in front of PostgreSQL that can stop passing bytes either way without
/// closing anything: what a paused server (SIGSTOP, a VM frozen) or a cut network looks like to
/// its clients. What arrives meanwhile is passed on once it is thawed.
struct FreezingProxy {
    port: u16,
    frozen: tokio::sync::watch::Sender<bool>,
}

impl FreezingProxy {
    async fn start(upstream: (String, u16)) -> FreezingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (frozen, _) = tokio::sync::watch::channel(false);
        let gate = frozen.clone();
        tokio::spawn(async move {
            loop {
                let (client, _) = listener.accept().await.unwrap();
                let server = tokio::net::TcpStream::connect((upstream.0.as_str(), upstream.1))
                    .await
                    .unwrap();
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                tokio::spawn(pass(client_read, server_write, gate.subscribe()));
                tokio::spawn(pass(server_read, client_write, gate.subscribe()));
            }
        });
        FreezingProxy { port, frozen }
    }

    fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }
}

/// Copy `from` to `to`, holding each read while `frozen` says so.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0_u8; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if frozen.wait_for(|frozen| !frozen).await.is_err()
            || to.write_all(&buffer[..read]).await.is_err()
        {
            return;
        }
    }
}

/// PostgreSQL stops answering without closing its connections. A read, a page and a grant are
/// each answered 503 with `Retry-After` at their deadline (the page and the problem in the
/// reader's language), not held for as long as the server stays away. Once it answers again,
/// the grant sent again with its Idempotency-Key is granted once, and `audit verify` is clean.
// Multi-threaded: the proxy goes on passing bytes while `audit verify` (a process the test
// waits for, blocking its thread) connects through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_that_stops_answering_is_a_503_at_the_deadline_and_a_grant_sent_again_lands_once()
 {
    let database = crate::helpers::create_database().await;
    let direct = crate::helpers::test_settings(&database);
    let proxy = FreezingProxy::start(crate::helpers::postgres_address(&direct)).await;
    let url = crate::helpers::postgres_url_via(&direct, proxy.port);
    let app = spawn_app_at(&url, |settings| {
        settings.database.failover_wait_ms = 1_000;
        settings.http.read_deadline_ms = 1_000;
        settings.http.write_deadline_ms = 2_000;
    })
    .await;
    let user = app.register("frozen-user", "correct horse battery").await;
    let token = app.login("frozen-user", "correct horse battery").await;
    let admin = app.admin_token("admin-frozen").await;
    let grant = |key: &'static str| {
        app.http
            .post(format!(
                "{}/api/v1/admin/accounts/{user}/grants",
                app.address
            ))
            .bearer_auth(&admin)
            .header("Idempotency-Key", key)
            .json(&json!({"amount": "8", "reason": "补偿：服务器暂停"}))
            .send()
    };
    assert_eq!(grant("warm-up").await.unwrap().status(), 201);
    assert_eq!(app.get_as(&token, "/api/v1/tasks").await.status(), 200);

    proxy.freeze(true);
    let started = Instant::now();
    let read = app
        .http
        .get(format!("{}/api/v1/tasks", app.address))
        .bearer_auth(&token)
        .header("Accept-Language", "zh-CN")
        .timeout(WAIT_LIMIT)
        .send()
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(read.status(), 503);
    assert_eq!(read.headers()["retry-after"], "2");
    let problem: Value = read.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/request-overdue", "{problem}");
    assert_eq!(problem["title"], "请求超时");
    assert!(waited < Duration::from_secs(5), "answered after {waited:?}");

    let page = app
        .http
        .get(format!("{}/history", app.address))
        .header("Cookie", format!("zhihui_session={token}; lang=zh"))
        .header("Accept", "text/html")
        .timeout(WAIT_LIMIT)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 503);
    assert_eq!(page.headers()["retry-after"], "2");
    let body = page.text().await.unwrap();
    assert!(body.contains("服务响应超时"), "{body}");

    let overdue = grant("during-the-freeze").await.unwrap();
    assert_eq!(overdue.status(), 503);
    assert_eq!(overdue.headers()["retry-after"], "2");

    proxy.freeze(false);
    let again = grant("during-the-freeze").await.unwrap();
    assert!([200, 201].contains(&again.status().as_u16()), "{again:?}");
    assert_eq!(app.get_as(&token, "/api/v1/tasks").await.status(), 200);
    let (available, _) = crate::instances::balance_via(&app, &token).await;
    assert_eq!(available, "16.00");
    crate::tasks::project_and_verify(&app).await;
}
