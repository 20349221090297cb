//! Money under chaos, across two `zhihui serve` OS processes (not a benchmark: a soak whose
//! figures are its outcome). Both processes serve HTTP, run projections and process managers and
//! may lead the dispatcher; two ComfyUI simulators run the tasks. Users submit tasks, prioritise
//! and cancel them, redeem codes (each code tried by several users) and claim a flash sale, each
//! request to a random process (retried on the other, with the same `Idempotency-Key`, while one
//! is down), while in turn:
//!
//! 1. process A is killed with SIGKILL and restarted; 2. process B likewise;
//! 3. Redis is flushed (`FLUSHDB` of the run's own Redis database), or, on a Redis Cluster, the
//!    master holding the queue is killed with SIGKILL (its replica promoted by the cluster) and
//!    later started again (`CHAOS_REDIS_KILL`, `CHAOS_REDIS_RESTART`);
//! 4. PostgreSQL is restarted, or its primary killed and the standby promoted (the command in
//!    `CHAOS_PG_RESTART`: `pg_ctl restart`, or `scripts/services.sh kill-primary` then
//!    `promote-standby` when `scripts/chaos.sh` runs with `CHAOS_PG_FAILOVER=1`);
//! 5. a simulator is crashed (its sockets and queue lost) and restarted.
//!
//! Then it waits until every task has ended, and past the settlement bounds, and runs
//! `zhihui audit verify` (every difference and pending settlement printed) and
//! `zhihui audit repairs`. It exits non-zero on a difference, a pending settlement, a task that
//! never ended, or a task that ended twice. For each fault it prints the time from the fault to
//! the first submit that succeeded after it.
//!
//!     scripts/chaos.sh [TASKS]          # builds, starts the services, sets the variables
//!
//! Variables: DATABASE_URL (a database to CREATE DATABASE from), REDIS_URL (its database number is
//! flushed: give it one of its own), ZHIHUI_BIN (the `zhihui` binary), CHAOS_PG_RESTART (a shell
//! command; without it step 4 is skipped and said so); for a Redis Cluster
//! CHAOS_REDIS_CLUSTER_NODES (the seed URLs), CHAOS_REDIS_KILL (a shell command that kills a
//! master and prints its port) and CHAOS_REDIS_RESTART (a shell command given that port as
//! `$PORT`).

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use comfyui_sim::{Faults, SimConfig, Simulator};
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::Mutex;
use uuid::Uuid;

const USERS: usize = 20;
/// Codes in the run's batch; each redemption picks one at random, so most are tried by several
/// users (one may have it).
const CODES: usize = 40;
/// The flash sale's stock: fewer than the users, every one of whom claims.
const SALE_STOCK: u64 = 8;
const TASKS_DEFAULT: usize = 220;
/// Longest the whole run may wait for tasks to end after the load (a hang, not a slow machine).
const END_WAIT_MAX: Duration = Duration::from_secs(300);
/// Settlement timings of the run (short, so that the bounds pass within minutes).
const INTENT_RESOLVE_AFTER_MS: u64 = 17_000;
const INTENT_SWEEP_INTERVAL_MS: u64 = 2_000;
const SETTLEMENT_AFTER_MS: u64 = 3_000;
/// The five faults come 6 s apart: submits are spread over this.
const FAULT_WINDOW_MS: u64 = 32_000;

/// One `zhihui serve` child.
struct Serve {
    name: &'static str,
    child: tokio::process::Child,
    address: String,
    port: u16,
}

#[derive(Clone)]
struct Run {
    bin: String,
    database_url: String,
    redis_url: String,
    cluster_nodes: String,
    prefix: String,
    backends: String,
    images: String,
}

impl Run {
    fn command(&self, args: &[&str]) -> std::process::Command {
        let mut command = std::process::Command::new(&self.bin);
        command
            .args(args)
            .env("ZHIHUI_DATABASE__URL", &self.database_url)
            .env("ZHIHUI_DATABASE__MIGRATE_ON_START", "false")
            .env("ZHIHUI_LOG__FILTER", "warn")
            .envs(settlement_timings());
        command
    }

    async fn serve(&self, name: &'static str, port: u16) -> anyhow::Result<Serve> {
        let child = tokio::process::Command::new(&self.bin)
            .arg("serve")
            .env("ZHIHUI_DATABASE__URL", &self.database_url)
            .env("ZHIHUI_DATABASE__POOL_MAX_SIZE", "12")
            .env("ZHIHUI_REDIS__URL", &self.redis_url)
            .env("ZHIHUI_REDIS__CLUSTER_NODES", &self.cluster_nodes)
            .env("ZHIHUI_REDIS__KEY_PREFIX", &self.prefix)
            .env("ZHIHUI_HTTP__PORT", port.to_string())
            .env("ZHIHUI_HTTP__WORKERS", "2")
            .env("ZHIHUI_TRANSLATION__ENABLED", "false")
            .env("ZHIHUI_DISPATCH__BACKENDS", &self.backends)
            .env("ZHIHUI_DISPATCH__IMAGES_DIRECTORY", &self.images)
            .env("ZHIHUI_DISPATCH__RECONCILE_INTERVAL_MS", "1000")
            .env("ZHIHUI_DISPATCH__TASK_TIMEOUT_MS", "60000")
            .envs(settlement_timings())
            .env("ZHIHUI_TASKS__QUEUED_PER_USER_MAX", "1000")
            .env(
                "ZHIHUI_LOG__FILTER",
                "warn,zhihui::points::settlements=warn",
            )
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting zhihui serve")?;
        let address = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if let Ok(response) = http.get(format!("{address}/ready")).send().await
                && response.status() == 200
            {
                break;
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(60),
                "{name} never got ready"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Serve {
            name,
            child,
            address,
            port,
        })
    }
}

/// The run's settlement timings, the same for the servers and the CLI (`audit verify` reads its
/// settlement bound from them).
fn settlement_timings() -> [(&'static str, String); 4] {
    [
        (
            "ZHIHUI_TASKS__INTENT_RESOLVE_AFTER_MS",
            INTENT_RESOLVE_AFTER_MS.to_string(),
        ),
        (
            "ZHIHUI_TASKS__INTENT_SWEEP_INTERVAL_MS",
            INTENT_SWEEP_INTERVAL_MS.to_string(),
        ),
        (
            "ZHIHUI_TASKS__SETTLEMENT_AFTER_MS",
            SETTLEMENT_AFTER_MS.to_string(),
        ),
        ("ZHIHUI_TASKS__SETTLEMENT_INTERVAL_MS", "1000".into()),
    ]
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A request sent to a random process, then to the other while it fails to answer.
async fn send(
    http: &reqwest::Client,
    addresses: &[String; 2],
    build: impl Fn(&reqwest::Client, &str) -> reqwest::RequestBuilder,
) -> Option<reqwest::Response> {
    let first = rand::rng().random_range(0..2);
    let started = Instant::now();
    let mut attempt = 0;
    while started.elapsed() < Duration::from_secs(60) {
        let address = &addresses[(first + attempt) % 2];
        attempt += 1;
        match build(http, address)
            .timeout(Duration::from_secs(15))
            .send()
            .await
        {
            // A process mid-restart or PostgreSQL restarting: try the other, then again.
            Ok(response) if response.status().is_server_error() => {}
            Ok(response) => return Some(response),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    None
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let tasks_total: usize = match std::env::args().nth(1) {
        Some(count) => count.parse().context("TASKS must be a number")?,
        None => TASKS_DEFAULT,
    };
    let bin = std::env::var("ZHIHUI_BIN").context("ZHIHUI_BIN names the zhihui binary")?;
    let admin_url = std::env::var("DATABASE_URL").context("DATABASE_URL")?;
    let redis_url = std::env::var("REDIS_URL").context("REDIS_URL")?;
    let pg_restart = std::env::var("CHAOS_PG_RESTART").ok();
    let cluster_nodes = std::env::var("CHAOS_REDIS_CLUSTER_NODES").unwrap_or_default();
    let redis_kill = std::env::var("CHAOS_REDIS_KILL")
        .ok()
        .filter(|_| !cluster_nodes.is_empty());
    let redis_restart = std::env::var("CHAOS_REDIS_RESTART").ok();

    let database = format!("zhihui_chaos_{}", Uuid::now_v7().simple());
    let (admin, connection) = tokio_postgres_connect(&admin_url).await?;
    let _connection = tokio::spawn(connection);
    admin
        .simple_query(&format!("CREATE DATABASE {database}"))
        .await
        .context("creating the run's database")?;
    // The run's database on the same server(s), the URL's parameters kept (a multi-host URL's
    // `target_session_attrs=read-write` is what finds a promoted standby).
    let (without_query, query) = match admin_url.split_once('?') {
        Some((head, query)) => (head, format!("?{query}")),
        None => (admin_url.as_str(), String::new()),
    };
    let database_url = match without_query.rsplit_once('/') {
        Some((base, _)) => format!("{base}/{database}{query}"),
        None => anyhow::bail!("DATABASE_URL has no database name"),
    };
    let scratch = std::env::current_dir()?
        .join("target")
        .join("tmp")
        .join(&database);
    std::fs::create_dir_all(&scratch)?;
    let mut sims = Vec::new();
    for index in 0..2 {
        sims.push(Arc::new(
            Simulator::start(SimConfig {
                bind: "127.0.0.1:0".parse()?,
                output_dir: scratch.join(format!("sim-{index}")),
                models: vec!["majicmixRealistic_v7.safetensors".into()],
                faults: Faults {
                    // 20 steps of 30 ms: two servers take about 3 tasks/s while about 7/s arrive,
                    // so a queue builds and prioritises and cancels meet waiting tasks.
                    step_delay_ms: 30,
                    fast_png: true,
                    ..Faults::default()
                },
            })
            .await?,
        ));
    }
    let run = Run {
        bin,
        database_url,
        redis_url: redis_url.clone(),
        cluster_nodes: cluster_nodes.clone(),
        prefix: database.clone(),
        backends: sims
            .iter()
            .enumerate()
            .map(|(index, sim)| format!("gpu-{index} {} 1", sim.base_url()))
            .collect::<Vec<_>>()
            .join(","),
        images: scratch.join("images").to_string_lossy().into_owned(),
    };
    let migrated = run.command(&["migrate"]).output()?;
    anyhow::ensure!(migrated.status.success(), "zhihui migrate failed");
    let mut create = run
        .command(&[
            "users",
            "create",
            "chaos-admin",
            "--admin",
            "--password-stdin",
        ])
        .stdin(Stdio::piped())
        .spawn()?;
    {
        use std::io::Write;
        create
            .stdin
            .take()
            .context("stdin")?
            .write_all(b"chaos admin password\n")?;
    }
    anyhow::ensure!(create.wait()?.success(), "creating the admin failed");

    let ports = [free_port()?, free_port()?];
    let a = run.serve("A", ports[0]).await?;
    let b = run.serve("B", ports[1]).await?;
    let addresses = [a.address.clone(), b.address.clone()];
    let processes = Arc::new(Mutex::new([Some(a), Some(b)]));
    let http = reqwest::Client::new();

    let login = |name: String, password: &'static str| {
        let http = http.clone();
        let addresses = addresses.clone();
        async move {
            let answer = send(&http, &addresses, |http, address| {
                http.post(format!("{address}/api/v1/auth/login"))
                    .json(&json!({"username": name, "password": password}))
            })
            .await
            .context("login never answered")?;
            let body: Value = answer.json().await?;
            body["token"]
                .as_str()
                .map(str::to_owned)
                .context("no token in the login answer")
        }
    };
    let admin_token = login("chaos-admin".into(), "chaos admin password").await?;
    let mut users = Vec::new();
    for index in 0..USERS {
        let name = format!("chaos-{index}");
        let registered = send(&http, &addresses, |http, address| {
            http.post(format!("{address}/api/v1/auth/register"))
                .json(&json!({"username": name, "password": "correct horse battery"}))
        })
        .await
        .context("register")?;
        let body: Value = registered.json().await?;
        let user = body["id"].as_str().context("user id")?.to_owned();
        let token = login(name, "correct horse battery").await?;
        let key = Uuid::now_v7().to_string();
        let granted = send(&http, &addresses, |http, address| {
            http.post(format!("{address}/api/v1/admin/accounts/{user}/grants"))
                .bearer_auth(&admin_token)
                .header("Idempotency-Key", &key)
                .json(&json!({"amount": "100", "reason": "chaos"}))
        })
        .await
        .context("grant")?;
        anyhow::ensure!(
            granted.status() == 201,
            "grant answered {}",
            granted.status()
        );
        users.push((user, token));
    }

    // A batch of codes (issued by the processes' generator) and a flash sale, both open now.
    let now = chrono::Utc::now();
    let created = send(&http, &addresses, |http, address| {
        http.post(format!("{address}/api/v1/admin/code-batches"))
            .bearer_auth(&admin_token)
            .json(&json!({"count": CODES, "points": "5", "valid_from": now - chrono::Duration::hours(1),
                "valid_until": now + chrono::Duration::hours(2), "note": "混沌测试"}))
    })
    .await
    .context("creating a code batch")?;
    anyhow::ensure!(
        created.status() == 202,
        "code batch answered {}",
        created.status()
    );
    let batch: Value = created.json().await?;
    let batch_id = batch["batch_id"].as_str().context("batch id")?.to_owned();
    let codes = {
        let issued_by = Instant::now();
        loop {
            let shown: Value = send(&http, &addresses, |http, address| {
                http.get(format!("{address}/api/v1/admin/code-batches/{batch_id}"))
                    .bearer_auth(&admin_token)
            })
            .await
            .context("reading the code batch")?
            .json()
            .await?;
            if shown["issued"].as_u64() == Some(CODES as u64) {
                break;
            }
            anyhow::ensure!(
                issued_by.elapsed() < Duration::from_secs(60),
                "the batch was never issued: {shown}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        export_codes(&http, &addresses, &admin_token, &batch_id)
            .await?
            .into_iter()
            .map(|(code, _)| code)
            .collect::<Vec<String>>()
    };
    let sale = send(&http, &addresses, |http, address| {
        http.post(format!("{address}/api/v1/admin/promotions"))
            .bearer_auth(&admin_token)
            .json(&json!({"title": "限时抢购", "points": "10", "price": "1", "stock": SALE_STOCK,
                "starts_at": now - chrono::Duration::hours(1), "ends_at": now + chrono::Duration::hours(2)}))
    })
    .await
    .context("creating the flash sale")?;
    anyhow::ensure!(sale.status() == 201, "promotion answered {}", sale.status());
    let sale: Value = sale.json().await?;
    let promotion_id = sale["promotion_id"]
        .as_str()
        .context("promotion id")?
        .to_owned();

    // The faults, in turn, while the load runs.
    let faults_done = Arc::new(AtomicUsize::new(0));
    let fault_log = Arc::new(Mutex::new(Vec::<String>::new()));
    // Per fault: when it struck, and how long until a submit sent after it succeeded.
    let recoveries = Arc::new(Mutex::new(Vec::<(String, Instant, Option<Duration>)>::new()));
    let chaos = {
        let recoveries = recoveries.clone();
        let processes = processes.clone();
        let run = run.clone();
        let sims = sims.clone();
        let fault_log = fault_log.clone();
        let faults_done = faults_done.clone();
        let redis_url = redis_url.clone();
        let redis_kill = redis_kill.clone();
        let redis_restart = redis_restart.clone();
        tokio::spawn(async move {
            let note = |line: String| {
                let fault_log = fault_log.clone();
                async move {
                    println!("chaos: {line}");
                    fault_log.lock().await.push(line);
                }
            };
            for step in 0..5 {
                tokio::time::sleep(Duration::from_secs(6)).await;
                let fault = [
                    "process A killed",
                    "process B killed",
                    if redis_kill.is_some() {
                        "Redis master killed"
                    } else {
                        "Redis flushed"
                    },
                    "PostgreSQL",
                    "simulator crashed",
                ][step];
                recoveries
                    .lock()
                    .await
                    .push((fault.to_owned(), Instant::now(), None));
                match step {
                    0 | 1 => {
                        let mut guard = processes.lock().await;
                        let Some(mut serve) = guard[step].take() else {
                            continue;
                        };
                        let (name, port) = (serve.name, serve.port);
                        drop(serve.child.start_kill());
                        drop(serve.child.wait().await);
                        drop(guard);
                        note(format!("process {name} killed with SIGKILL")).await;
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        match run.serve(name, port).await {
                            Ok(serve) => processes.lock().await[step] = Some(serve),
                            Err(error) => {
                                note(format!("restarting {name} failed: {error:#}")).await
                            }
                        }
                        note(format!("process {name} restarted")).await;
                    }
                    2 if redis_kill.is_some() => {
                        let kill = redis_kill.as_deref().unwrap_or_default();
                        let killed = tokio::process::Command::new("sh")
                            .arg("-c")
                            .arg(kill)
                            .output()
                            .await;
                        let port = killed
                            .as_ref()
                            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
                            .unwrap_or_default();
                        note(format!(
                            "Redis master on port {port} killed with SIGKILL (`{kill}`)"
                        ))
                        .await;
                        // Down long enough for its replica to be promoted, then back as a replica.
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        if let Some(restart) = &redis_restart {
                            let status = tokio::process::Command::new("sh")
                                .arg("-c")
                                .arg(restart)
                                .env("PORT", &port)
                                .stdout(Stdio::null())
                                .status()
                                .await;
                            note(format!("Redis node {port} started again ({status:?})")).await;
                        }
                    }
                    2 => {
                        let flushed = async {
                            let client = redis::Client::open(redis_url.as_str())?;
                            let mut connection = client.get_multiplexed_async_connection().await?;
                            redis::cmd("FLUSHDB")
                                .query_async::<()>(&mut connection)
                                .await?;
                            anyhow::Ok(())
                        };
                        match flushed.await {
                            Ok(()) => note("Redis flushed (FLUSHDB)".into()).await,
                            Err(error) => note(format!("flushing Redis failed: {error:#}")).await,
                        }
                    }
                    3 => match &pg_restart {
                        Some(command) => {
                            let status = tokio::process::Command::new("sh")
                                .arg("-c")
                                .arg(command)
                                .stdout(Stdio::null())
                                .status()
                                .await;
                            note(format!("PostgreSQL: `{command}` ({status:?})")).await;
                        }
                        None => {
                            note("PostgreSQL restart SKIPPED: no CHAOS_PG_RESTART".into()).await
                        }
                    },
                    _ => {
                        sims[0].crash().await;
                        note("simulator gpu-0 crashed".into()).await;
                        tokio::time::sleep(Duration::from_secs(3)).await;
                        sims[0].restart().await;
                        note("simulator gpu-0 restarted".into()).await;
                    }
                }
                faults_done.fetch_add(1, Ordering::SeqCst);
            }
        })
    };

    // The load: submits, with prioritises and cancels of the user's earlier tasks.
    let started = Instant::now();
    let mut submitted: Vec<(usize, String)> = Vec::new();
    let mut answers: HashMap<String, usize> = HashMap::new();
    let (mut moves_asked, mut cancels_asked) = (0, 0);
    let mut relogin = [false; USERS];
    // Per code, the users it was answered 200 to; per user, the claim's final answer.
    let mut redeemed: HashMap<String, HashSet<usize>> = HashMap::new();
    let mut redeem_answers: HashMap<u16, usize> = HashMap::new();
    let mut claimed: [Option<u16>; USERS] = [None; USERS];
    while submitted.len() < tasks_total || faults_done.load(Ordering::SeqCst) < 5 {
        let who = rand::rng().random_range(0..USERS);
        // Sessions live in Redis: after the flush every token is gone (401); log in again.
        if relogin[who] {
            users[who].1 = login(format!("chaos-{who}"), "correct horse battery").await?;
            relogin[who] = false;
        }
        let token = &users[who].1;
        let roll = rand::rng().random_range(0..10);
        let mine: Vec<&String> = submitted
            .iter()
            .filter(|(owner, _)| *owner == who)
            .map(|(_, task)| task)
            .collect();
        if roll == 2 {
            let code = codes[rand::rng().random_range(0..codes.len())].clone();
            let key = Uuid::now_v7().to_string();
            if let Some(answer) = send(&http, &addresses, |http, address| {
                http.post(format!("{address}/api/v1/codes/redeem"))
                    .bearer_auth(token)
                    .header("Idempotency-Key", &key)
                    .json(&json!({"code": code}))
            })
            .await
            {
                let status = answer.status().as_u16();
                relogin[who] = status == 401;
                *redeem_answers.entry(status).or_default() += 1;
                if status == 200 {
                    redeemed.entry(code).or_default().insert(who);
                }
            }
        } else if roll == 3 && claimed[who].is_none() {
            if let Some(answer) = send(&http, &addresses, |http, address| {
                http.post(format!("{address}/api/v1/promotions/{promotion_id}/claims"))
                    .bearer_auth(token)
                    .json(&json!({}))
            })
            .await
            {
                let status = answer.status().as_u16();
                relogin[who] = status == 401;
                if status == 202 || status == 409 {
                    claimed[who] = Some(status);
                }
            }
        } else if roll < 2 && !mine.is_empty() {
            let task = mine[rand::rng().random_range(0..mine.len())].clone();
            let action = if roll == 0 { "prioritise" } else { "cancel" };
            let key = Uuid::now_v7().to_string();
            if let Some(answer) = send(&http, &addresses, |http, address| {
                http.post(format!("{address}/api/v1/tasks/{task}/{action}"))
                    .bearer_auth(token)
                    .header("Idempotency-Key", &key)
            })
            .await
            {
                relogin[who] = answer.status() == 401;
                *answers
                    .entry(format!("{action} {}", answer.status().as_u16()))
                    .or_default() += 1;
            }
            if roll == 0 {
                moves_asked += 1;
            } else {
                cancels_asked += 1;
            }
        } else if submitted.len() < tasks_total {
            let key = Uuid::now_v7().to_string();
            let sent_at = Instant::now();
            let answer = send(&http, &addresses, |http, address| {
                http.post(format!("{address}/api/v1/tasks"))
                    .bearer_auth(token)
                    .header("Idempotency-Key", &key)
                    .json(&json!({"prompt": "chaos", "images": 1, "steps": 20}))
            })
            .await;
            match answer {
                Some(answer) if answer.status() == 201 || answer.status() == 200 => {
                    let body: Value = answer.json().await?;
                    submitted.push((who, body["task_id"].as_str().context("task id")?.into()));
                    *answers.entry("submit 201".into()).or_default() += 1;
                    for (_, struck, back) in recoveries.lock().await.iter_mut() {
                        if back.is_none() && sent_at > *struck {
                            *back = Some(struck.elapsed());
                        }
                    }
                }
                Some(answer) => {
                    relogin[who] = answer.status() == 401;
                    *answers
                        .entry(format!("submit {}", answer.status().as_u16()))
                        .or_default() += 1;
                }
                None => *answers.entry("submit no answer".into()).or_default() += 1,
            }
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Spread the submits over the whole fault window (a mean pause of one pace), so every
        // fault meets submits and tasks in flight.
        let pace_ms = FAULT_WINDOW_MS / tasks_total.max(1) as u64;
        tokio::time::sleep(Duration::from_millis(
            rand::rng().random_range(0..=pace_ms.saturating_mul(2)),
        ))
        .await;
    }
    chaos.await?;
    // Every user gets to claim the sale once (some may have had no turn during the load).
    for who in 0..USERS {
        while claimed[who].is_none() {
            let answer = send(&http, &addresses, |http, address| {
                http.post(format!("{address}/api/v1/promotions/{promotion_id}/claims"))
                    .bearer_auth(&users[who].1)
                    .json(&json!({}))
            })
            .await
            .context("a claim never answered")?;
            match answer.status().as_u16() {
                401 => {
                    users[who].1 = login(format!("chaos-{who}"), "correct horse battery").await?
                }
                status @ (202 | 409) => claimed[who] = Some(status),
                status => anyhow::bail!("a claim answered {status}"),
            }
        }
    }
    println!(
        "load: {} tasks submitted, {moves_asked} prioritises and {cancels_asked} cancels asked in {:.1} s; answers {answers:?}",
        submitted.len(),
        started.elapsed().as_secs_f64()
    );

    // Every task ends (read through either process).
    let waiting_since = Instant::now();
    let mut ended: HashMap<String, String> = HashMap::new();
    while ended.len() < submitted.len() {
        anyhow::ensure!(
            waiting_since.elapsed() < END_WAIT_MAX,
            "{} task(s) never ended",
            submitted.len() - ended.len()
        );
        for (who, task) in &submitted {
            if ended.contains_key(task) {
                continue;
            }
            let token = users[*who].1.clone();
            if let Some(answer) = send(&http, &addresses, |http, address| {
                http.get(format!("{address}/api/v1/tasks/{task}"))
                    .bearer_auth(&token)
            })
            .await
            {
                if answer.status() == 401 {
                    users[*who].1 = login(format!("chaos-{who}"), "correct horse battery").await?;
                    continue;
                }
                let body: Value = answer.json().await.unwrap_or_default();
                let status = body["status"].as_str().unwrap_or_default().to_owned();
                if ["succeeded", "failed", "cancelled"].contains(&status.as_str()) {
                    ended.insert(task.clone(), status);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut by_status: HashMap<&str, usize> = HashMap::new();
    for status in ended.values() {
        *by_status.entry(status.as_str()).or_default() += 1;
    }
    println!(
        "every task ended after {:.1} s: {by_status:?}",
        waiting_since.elapsed().as_secs_f64()
    );

    // Past the bounds (the intent sweeper's and the reconciler's), with the projections caught up.
    let bound = Duration::from_millis(INTENT_RESOLVE_AFTER_MS + INTENT_SWEEP_INTERVAL_MS + 5_000);
    println!(
        "waiting {:.0} s for the settlement bounds",
        bound.as_secs_f64()
    );
    tokio::time::sleep(bound).await;
    let mut differences = usize::MAX;
    let mut pending = usize::MAX;
    let mut verify_output = String::new();
    for _ in 0..10 {
        let verified = run.command(&["audit", "verify"]).output()?;
        verify_output = String::from_utf8_lossy(&verified.stdout).into_owned();
        let summary = verify_output
            .lines()
            .find(|line| line.starts_with("audit verify:"))
            .unwrap_or_default()
            .to_owned();
        let number_before = |word: &str| -> usize {
            summary
                .split(", ")
                .find(|part| part.contains(word))
                .and_then(|part| part.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(usize::MAX)
        };
        differences = if verified.status.success() {
            0
        } else {
            number_before("difference")
        };
        pending = number_before("settlement(s) pending");
        if differences == 0 && pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    print!("{verify_output}");
    let repairs = run.command(&["audit", "repairs"]).output()?;
    print!("{}", String::from_utf8_lossy(&repairs.stdout));
    let repair_count = String::from_utf8_lossy(&repairs.stdout)
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);

    // Each code redeemed at most once: answered 200 to one user at most, and the store names
    // that user; the sale granted exactly its stock. Sessions live in Redis: a flush ended the
    // admin's too, so the admin logs in again (its old token would read every answer as 401).
    let admin_token = login("chaos-admin".into(), "chaos admin password").await?;
    let in_store = export_codes(&http, &addresses, &admin_token, &batch_id).await?;
    let mut codes_twice = 0;
    let mut codes_not_in_store = 0;
    for (code, winners) in &redeemed {
        if winners.len() > 1 {
            codes_twice += 1;
        }
        let holder = in_store
            .iter()
            .find(|(stored, _)| stored == code)
            .map(|(_, holder)| holder.clone())
            .unwrap_or_default();
        if winners.iter().any(|who| users[*who].0 != holder) {
            codes_not_in_store += 1;
        }
    }
    let redeemed_in_store = in_store
        .iter()
        .filter(|(_, holder)| !holder.is_empty())
        .count();
    println!(
        "codes: {} redemptions answered {redeem_answers:?}; {} codes answered 200, {redeemed_in_store} redeemed in the store, {codes_twice} answered 200 to two users, {codes_not_in_store} whose store holder differs",
        redeem_answers.values().sum::<usize>(),
        redeemed.len()
    );
    let accepted = claimed
        .iter()
        .filter(|answer| **answer == Some(202))
        .count();
    let settled_by = Instant::now();
    let granted = loop {
        let shown: Value = send(&http, &addresses, |http, address| {
            http.get(format!("{address}/api/v1/admin/promotions/{promotion_id}"))
                .bearer_auth(&admin_token)
        })
        .await
        .context("reading the sale")?
        .error_for_status()
        .context("reading the sale")?
        .json()
        .await?;
        let granted = shown["granted"].as_u64().unwrap_or(0);
        if granted >= SALE_STOCK || settled_by.elapsed() > Duration::from_secs(60) {
            break granted;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!(
        "flash sale: stock {SALE_STOCK}, {USERS} users claimed, {accepted} accepted at the gate, {granted} granted"
    );

    // Each task ended once: its stream holds exactly one end.
    let mut twice = HashSet::new();
    for (_, task) in &submitted {
        let shown = run
            .command(&["events", "show", &format!("task-{task}"), "--json"])
            .output()?;
        let text = String::from_utf8_lossy(&shown.stdout);
        let ends = ["TaskSucceeded", "TaskFailed", "TaskCancelled"]
            .iter()
            .map(|end| text.matches(&format!("\"{end}\"")).count())
            .sum::<usize>();
        if ends != 1 {
            twice.insert(task.clone());
        }
    }
    for line in fault_log.lock().await.iter() {
        println!("fault: {line}");
    }
    for (fault, _, back) in recoveries.lock().await.iter() {
        match back {
            Some(back) => println!(
                "first submit that succeeded after \"{fault}\": {} ms later",
                back.as_millis()
            ),
            None => println!("no submit succeeded after \"{fault}\""),
        }
    }
    println!("RESULT chaos_codes_redeemed_twice {codes_twice} codes");
    println!("RESULT chaos_sale_granted {granted} of {SALE_STOCK}");
    println!("RESULT chaos_tasks {} tasks", submitted.len());
    println!("RESULT chaos_tasks_not_ended_once {} tasks", twice.len());
    println!("RESULT chaos_repairs {repair_count} repairs");
    println!("RESULT chaos_pending_settlements {pending} settlements");
    println!("RESULT chaos_audit_differences {differences} differences");
    for process in processes.lock().await.iter_mut() {
        drop(process.take());
    }
    for sim in sims {
        if let Ok(sim) = Arc::try_unwrap(sim) {
            sim.stop().await;
        }
    }
    drop(std::fs::remove_dir_all(&scratch));
    anyhow::ensure!(
        twice.is_empty()
            && differences == 0
            && pending == 0
            && codes_twice == 0
            && codes_not_in_store == 0
            && granted == SALE_STOCK,
        "the books do not agree"
    );
    Ok(())
}

/// The batch's codes from the admin CSV export: (code, the user who redeemed it or "").
async fn export_codes(
    http: &reqwest::Client,
    addresses: &[String; 2],
    admin_token: &str,
    batch_id: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let csv = send(http, addresses, |http, address| {
        http.get(format!(
            "{address}/api/v1/admin/code-batches/{batch_id}/codes.csv"
        ))
        .bearer_auth(admin_token)
    })
    .await
    .context("exporting the codes")?
    .error_for_status()
    .context("exporting the codes")?
    .text()
    .await?;
    // serial,code,points,valid_from,valid_until,redeemed_by,redeemed_at
    Ok(csv
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            (fields.len() == 7).then(|| (fields[1].to_owned(), fields[5].to_owned()))
        })
        .collect())
}

async fn tokio_postgres_connect(
    url: &str,
) -> anyhow::Result<(
    tokio_postgres::Client,
    tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
)> {
    tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .context("connecting to DATABASE_URL")
}
