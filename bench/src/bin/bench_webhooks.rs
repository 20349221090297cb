//! Webhook delivery under faults, across two `zhihui serve` processes that run the
//! tasks (two ComfyUI simulators) and deliver their ends.
//!
//! TASKS tasks (default 500) are submitted by 10 users over about a minute, each user with an
//! endpoint on a receiver in this program that verifies every delivery with the Standard
//! Webhooks reference library (not zhihui's code), and answers 500 to 30 % of attempts, stalls
//! past the sender's timeout on 10 %, and is down (its port closed) for a minute. Meanwhile the
//! process leading the webhooks (found from its advisory lock) is killed with SIGKILL and
//! restarted, twice. The retry schedule is the specification's shape scaled down to seconds.
//!
//! Reported: every task's end delivered at least once (none lost, or the program fails),
//! duplicates by `webhook-id` (deliveries acknowledged more than once), the delay from a task's
//! end to its first attempt and to its delivery (p50/p99); beside it, in the same run, what a
//! fire-once sender (the naive design) would have delivered: the messages whose first attempt
//! succeeded. Then a drain: every message redelivered to a receiver without faults, zhihui's
//! deliveries/s beside a bare `reqwest` loop posting the same signed bodies at the same
//! concurrency to the same receiver (the ceiling of this machine and receiver).
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo build --release -p zhihui -p zhihui-bench && target/release/bench_webhooks [TASKS]

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../serve/mod.rs"]
mod serve;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use anyhow::Context;
use comfyui_sim::{Faults, SimConfig, Simulator};
use rand::Rng;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, arg, percentile};
use zhihui::platform::configuration::Settings;

const USERS: usize = 10;
/// The sender's total timeout; a stalled answer takes longer.
const TIMEOUT_MS: u64 = 2_000;
const STALL: Duration = Duration::from_millis(3_000);
/// The specification's schedule (5 s, 5 min, 30 min, 2 h, ...) in seconds instead, long enough
/// to outlast the outage and a run of bad luck.
const SCHEDULE_MS: &str = "1000,2000,5000,10000,20000,30000,30000,30000,30000,30000,30000,30000,30000,30000,30000,30000,30000,30000,30000,30000";
const SUBMIT_WINDOW: Duration = Duration::from_secs(60);
const OUTAGE_AT: Duration = Duration::from_secs(15);
const OUTAGE: Duration = Duration::from_secs(60);
const KILLS_AT: [Duration; 2] = [Duration::from_secs(25), Duration::from_secs(50)];
const END_WAIT_MAX: Duration = Duration::from_secs(900);

// -------------------------------------------------------------------------------------------
// The receiver.

#[derive(Default)]
struct Seen {
    /// Per task: deliveries acknowledged (2xx), attempts that reached us.
    acknowledged: HashMap<String, u32>,
    arrived: HashMap<String, u32>,
    /// Per webhook-id: deliveries acknowledged.
    by_message: HashMap<String, u32>,
    /// When each acknowledgement was given.
    acknowledged_at: Vec<Instant>,
    /// When each attempt with a good signature reached us.
    arrived_at: Vec<Instant>,
    bad_signatures: u64,
    answered_500: u64,
    stalled: u64,
}

struct Receiver {
    secrets: Mutex<HashMap<String, standardwebhooks::Webhook>>,
    seen: Mutex<Seen>,
    faults: AtomicBool,
}

async fn hook(
    request: HttpRequest,
    body: web::Bytes,
    path: web::Path<String>,
    receiver: web::Data<Receiver>,
) -> HttpResponse {
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in request.headers() {
        if let (Ok(name), Ok(value)) = (
            reqwest::header::HeaderName::from_bytes(name.as_str().as_bytes()),
            reqwest::header::HeaderValue::from_bytes(value.as_bytes()),
        ) {
            headers.append(name, value);
        }
    }
    let verified = receiver
        .secrets
        .lock()
        .map(|secrets| {
            secrets
                .get(path.as_str())
                .is_some_and(|webhook| webhook.verify(&body, &headers).is_ok())
        })
        .unwrap_or(false);
    let message = headers
        .get("webhook-id")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let task = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|body| body["data"]["task_id"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let roll: f64 = rand::rng().random();
    let faults = receiver.faults.load(Ordering::SeqCst);
    {
        let Ok(mut seen) = receiver.seen.lock() else {
            return HttpResponse::InternalServerError().finish();
        };
        *seen.arrived.entry(task.clone()).or_default() += 1;
        if !verified {
            seen.bad_signatures += 1;
            return HttpResponse::BadRequest().body("bad signature");
        }
        seen.arrived_at.push(Instant::now());
        if faults && roll < 0.30 {
            seen.answered_500 += 1;
            return HttpResponse::InternalServerError().body("injected failure");
        }
        if faults && roll < 0.40 {
            seen.stalled += 1;
        } else {
            *seen.acknowledged.entry(task).or_default() += 1;
            *seen.by_message.entry(message).or_default() += 1;
            seen.acknowledged_at.push(Instant::now());
            return HttpResponse::Ok().body("ok");
        }
    }
    // Stalled past the sender's timeout: it gives up; this answer reaches nobody.
    tokio::time::sleep(STALL).await;
    HttpResponse::Ok().body("too late")
}

async fn listen(
    receiver: web::Data<Receiver>,
    port: u16,
) -> anyhow::Result<actix_web::dev::ServerHandle> {
    let server = HttpServer::new(move || {
        App::new()
            .app_data(receiver.clone())
            .route("/hook/{user}", web::post().to(hook))
    })
    .workers(2)
    .shutdown_timeout(0)
    .bind(("127.0.0.1", port))?
    .run();
    let handle = server.handle();
    tokio::spawn(server);
    Ok(handle)
}

// -------------------------------------------------------------------------------------------
// The processes.

struct Cluster {
    settings: Settings,
    env: Vec<(String, String)>,
    servers: Vec<serve::Server>,
}

impl Cluster {
    async fn start(&mut self) -> anyhow::Result<()> {
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .collect();
        self.servers
            .push(serve::start_server(&self.settings, &env).await?);
        Ok(())
    }

    fn bases(&self) -> Vec<String> {
        self.servers
            .iter()
            .map(|server| server.base.clone())
            .collect()
    }
}

/// The pid of the serve process holding the webhooks' leader lock: the lock's backend, its
/// client port, the socket with that port, the process with that socket.
async fn webhook_leader(
    client: &tokio_postgres::Client,
    pids: &[u32],
) -> anyhow::Result<Option<u32>> {
    let key = zhihui::platform::leader::lock_key(zhihui::webhooks::delivery::LEADER);
    let bits = u64::from_ne_bytes(key.to_ne_bytes());
    let (high, low) = ((bits >> 32) as u32, bits as u32);
    let row = client
        .query_opt(
            "SELECT a.client_port FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1 AND l.objid = $2",
            &[&high, &low],
        )
        .await?;
    let Some(port) = row.and_then(|row| row.get::<_, Option<i32>>(0)) else {
        return Ok(None);
    };
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields
                .get(1)
                .and_then(|local| local.rsplit_once(':'))
                .and_then(|(_, hex)| u16::from_str_radix(hex, 16).ok());
            if local_port.map(i32::from) == Some(port)
                && let Some(inode) = fields.get(9)
            {
                inodes.push(format!("socket:[{inode}]"));
            }
        }
    }
    for &pid in pids {
        let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for entry in entries.flatten() {
            if let Ok(target) = std::fs::read_link(entry.path())
                && inodes
                    .iter()
                    .any(|inode| target.to_string_lossy() == *inode)
            {
                return Ok(Some(pid));
            }
        }
    }
    Ok(None)
}

// -------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let tasks = arg(1)?.unwrap_or(500);
    zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.redis.url = SecretString::from(
                std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into()),
            );
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
        },
        |settings| async move { Box::pin(run(settings, tasks)).await },
    )
    .await
}

async fn run(settings: Settings, tasks_total: usize) -> anyhow::Result<Vec<Figure>> {
    let scratch = std::env::current_dir()?
        .join("target")
        .join("tmp")
        .join(format!("bench-webhooks-{}", Uuid::now_v7().simple()));
    let mut sims = Vec::new();
    for index in 0..2 {
        sims.push(
            Simulator::start(SimConfig {
                bind: "127.0.0.1:0".parse()?,
                output_dir: scratch.join(format!("sim-{index}")),
                models: vec!["majicmixRealistic_v7.safetensors".into()],
                faults: Faults {
                    step_delay_ms: 5,
                    fast_png: true,
                    ..Faults::default()
                },
            })
            .await?,
        );
    }
    let backends = sims
        .iter()
        .enumerate()
        .map(|(index, sim)| format!("gpu-{index} {} 4", sim.base_url()))
        .collect::<Vec<_>>()
        .join(",");
    let receiver = web::Data::new(Receiver {
        secrets: Mutex::new(HashMap::new()),
        seen: Mutex::new(Seen::default()),
        faults: AtomicBool::new(true),
    });
    let receiver_port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut receiver_handle = Some(listen(receiver.clone(), receiver_port).await?);

    let env: Vec<(String, String)> = [
        ("ZHIHUI_DISPATCH__ENABLED", "true".to_owned()),
        ("ZHIHUI_DISPATCH__BACKENDS", backends),
        (
            "ZHIHUI_DISPATCH__IMAGES_DIRECTORY",
            scratch.join("images").to_string_lossy().into_owned(),
        ),
        ("ZHIHUI_TRANSLATION__ENABLED", "false".into()),
        ("ZHIHUI_TASKS__QUEUED_PER_USER_MAX", "10000".into()),
        ("ZHIHUI_HTTP__WORKERS", "2".into()),
        ("ZHIHUI_WEBHOOKS__ALLOWED_NETWORKS", "127.0.0.0/8".into()),
        ("ZHIHUI_WEBHOOKS__RETRY_SCHEDULE_MS", SCHEDULE_MS.into()),
        ("ZHIHUI_WEBHOOKS__TIMEOUT_MS", TIMEOUT_MS.to_string()),
        ("ZHIHUI_WEBHOOKS__CONNECT_TIMEOUT_MS", "1000".into()),
        ("ZHIHUI_LOG__FILTER", "error".into()),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_owned(), value))
    .collect();
    let mut cluster = Cluster {
        settings: settings.clone(),
        env,
        servers: Vec::new(),
    };
    cluster.start().await?;
    cluster.start().await?;
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    let state =
        zhihui::state::AppState::build(&settings, pool, zhihui::state::Overrides::default())?;
    let (pg, connection) =
        tokio_postgres::connect(settings.database.url.expose_secret(), tokio_postgres::NoTls)
            .await?;
    tokio::spawn(connection);

    // Users, funded, each with an endpoint.
    let http = reqwest::Client::new();
    let base = cluster.bases()[0].clone();
    let mut tokens = Vec::new();
    for index in 0..USERS {
        let name = format!("shop-{index}");
        let registered: Value = http
            .post(format!("{base}/api/v1/auth/register"))
            .json(&json!({"username": name, "password": "correct horse battery"}))
            .send()
            .await?
            .json()
            .await?;
        let user = registered["id"].as_str().context("user id")?.to_owned();
        let login: Value = http
            .post(format!("{base}/api/v1/auth/login"))
            .json(&json!({"username": name, "password": "correct horse battery"}))
            .send()
            .await?
            .json()
            .await?;
        let token = login["token"].as_str().context("token")?.to_owned();
        zhihui::cli::bench_support::fund(
            &state.accounts,
            &[zhihui_domain::account::account_stream(
                zhihui_domain::user::UserId::from_uuid(Uuid::parse_str(&user)?),
            )],
        )
        .await?;
        let endpoint: Value = http
            .post(format!("{base}/api/v1/me/webhooks"))
            .bearer_auth(&token)
            .json(&json!({
                "url": format!("http://127.0.0.1:{receiver_port}/hook/{index}"),
                "event_types": ["task.succeeded", "task.failed", "task.cancelled"],
            }))
            .send()
            .await?
            .json()
            .await?;
        let secret = endpoint["secret"]
            .as_str()
            .with_context(|| format!("registering an endpoint: {endpoint}"))?;
        receiver
            .secrets
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .insert(index.to_string(), standardwebhooks::Webhook::new(secret)?);
        tokens.push(token);
    }

    // The load, and the faults on their schedule.
    let started = Instant::now();
    let mut submitted: Vec<String> = Vec::new();
    let mut outage_started = None;
    let mut kills_done = 0;
    let mut log = Vec::new();
    let pause = SUBMIT_WINDOW / u32::try_from(tasks_total.max(1))?;
    let mut next_submit = Instant::now();
    while submitted.len() < tasks_total || kills_done < KILLS_AT.len() || receiver_handle.is_none()
    {
        let elapsed = started.elapsed();
        if outage_started.is_none() && elapsed >= OUTAGE_AT {
            if let Some(handle) = receiver_handle.take() {
                handle.stop(false).await;
            }
            outage_started = Some(Instant::now());
            log.push(format!("{:>5.1} s receiver down", elapsed.as_secs_f64()));
        }
        if let Some(since) = outage_started
            && receiver_handle.is_none()
            && since.elapsed() >= OUTAGE
        {
            receiver_handle = Some(listen(receiver.clone(), receiver_port).await?);
            log.push(format!(
                "{:>5.1} s receiver up again",
                elapsed.as_secs_f64()
            ));
        }
        if kills_done < KILLS_AT.len() && elapsed >= KILLS_AT[kills_done] {
            let pids: Vec<u32> = cluster.servers.iter().map(|server| server.pid).collect();
            let leader = webhook_leader(&pg, &pids).await?;
            let index = leader
                .and_then(|pid| pids.iter().position(|candidate| *candidate == pid))
                .unwrap_or(0);
            let mut killed = cluster.servers.remove(index);
            killed.child.start_kill()?;
            killed.child.wait().await?;
            log.push(format!(
                "{:>5.1} s SIGKILL of pid {} ({})",
                elapsed.as_secs_f64(),
                killed.pid,
                if leader.is_some() {
                    "the webhooks' leader"
                } else {
                    "no leader found: the first process"
                }
            ));
            cluster.start().await?;
            kills_done += 1;
        }
        if submitted.len() < tasks_total && Instant::now() >= next_submit {
            let bases = cluster.bases();
            let index = submitted.len();
            let token = &tokens[index % USERS];
            let body = json!({"prompt": format!("第{index}张商品图：白底，柔光"), "steps": 2});
            let key = Uuid::now_v7().to_string();
            let mut task_id = None;
            for attempt in 0..40 {
                let base = &bases[(index + attempt) % bases.len()];
                if let Ok(response) = http
                    .post(format!("{base}/api/v1/tasks"))
                    .bearer_auth(token)
                    .header("Idempotency-Key", &key)
                    .json(&body)
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await
                    && response.status() == 201
                {
                    let answer: Value = response.json().await?;
                    task_id = answer["task_id"].as_str().map(str::to_owned);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            submitted.push(task_id.context("a submit never succeeded")?);
            next_submit += pause;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for line in &log {
        println!("{line}");
    }
    println!(
        "{} tasks submitted in {:.1} s",
        submitted.len(),
        started.elapsed().as_secs_f64()
    );

    // Wait until every task's end was acknowledged at least once.
    loop {
        let missing = {
            let seen = receiver
                .seen
                .lock()
                .map_err(|_| anyhow::anyhow!("poisoned"))?;
            submitted
                .iter()
                .filter(|task| !seen.acknowledged.contains_key(*task))
                .count()
        };
        if missing == 0 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < END_WAIT_MAX,
            "{missing} task ends never delivered: LOST"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let everything_at = started.elapsed();
    // A little longer: a retry still in flight is counted as the duplicate it is.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut figures: Vec<Figure> = Vec::new();
    {
        let seen = receiver
            .seen
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        let duplicates: u32 = seen
            .by_message
            .values()
            .map(|count| count.saturating_sub(1))
            .sum();
        let arrivals: u32 = seen.arrived.values().sum();
        println!(
            "every one of {} task ends delivered after {:.1} s; {} attempts reached the receiver \
             ({} answered 500, {} stalled past the timeout, {} bad signatures); {} duplicate \
             deliveries by webhook-id",
            submitted.len(),
            everything_at.as_secs_f64(),
            arrivals,
            seen.answered_500,
            seen.stalled,
            seen.bad_signatures,
            duplicates
        );
        anyhow::ensure!(seen.bad_signatures == 0, "a delivery did not verify");
        figures.push(("webhooks_lost".into(), 0.0, "messages"));
        figures.push((
            "webhooks_duplicates".into(),
            f64::from(duplicates),
            "messages",
        ));
    }
    // From the delivery log: the first attempt after the end, and delivery.
    let rows = pg
        .query(
            "SELECT extract(epoch FROM (a.attempted_at - m.occurred_at)) * 1000,
                    extract(epoch FROM (m.delivered_at - m.occurred_at)) * 1000,
                    a.status BETWEEN 200 AND 299
               FROM webhook_messages m
               JOIN webhook_attempts a ON a.endpoint_id = m.endpoint_id
                                      AND a.message_id = m.message_id AND a.attempt = 1",
            &[],
        )
        .await?;
    let mut first: Vec<f64> = Vec::new();
    let mut delivered: Vec<f64> = Vec::new();
    let mut fire_once = 0;
    for row in &rows {
        let decimal = |value: Option<rust_decimal::Decimal>| {
            value.and_then(|value| value.to_string().parse::<f64>().ok())
        };
        if let Some(ms) = decimal(row.get(0)) {
            first.push(ms);
        }
        if let Some(ms) = decimal(row.get(1)) {
            delivered.push(ms);
        }
        if row.get::<_, Option<bool>>(2) == Some(true) {
            fire_once += 1;
        }
    }
    first.sort_by(f64::total_cmp);
    delivered.sort_by(f64::total_cmp);
    let p = |samples: &[f64], q: f64| percentile(samples, q).unwrap_or(0.0);
    println!(
        "task end -> first attempt: p50 {:.0} ms, p99 {:.0} ms ({} messages with a logged first attempt)",
        p(&first, 0.5),
        p(&first, 0.99),
        first.len()
    );
    println!(
        "task end -> delivered: p50 {:.0} ms, p99 {:.0} ms",
        p(&delivered, 0.5),
        p(&delivered, 0.99)
    );
    println!(
        "the naive design (send once, no retry, no log) would have delivered {fire_once} of {}",
        submitted.len()
    );
    figures.push(("webhooks_first_attempt_p50".into(), p(&first, 0.5), "ms"));
    figures.push(("webhooks_first_attempt_p99".into(), p(&first, 0.99), "ms"));
    figures.push((
        "webhooks_fire_once_delivered".into(),
        f64::from(fire_once),
        "messages",
    ));

    // The drain: faults off; every message redelivered by its owner; zhihui's rate beside a bare
    // loop's to the same receiver.
    receiver.faults.store(false, Ordering::SeqCst);
    let acknowledged_before = acknowledged_total(&receiver)?;
    let base = cluster.bases()[0].clone();
    let drain_started = Instant::now();
    let mut queued = 0;
    for (index, token) in tokens.iter().enumerate() {
        let endpoints: Value = http
            .get(format!("{base}/api/v1/me/webhooks"))
            .bearer_auth(token)
            .send()
            .await?
            .json()
            .await?;
        let endpoint_id = endpoints[0]["endpoint_id"]
            .as_str()
            .with_context(|| format!("user {index}'s endpoint: {endpoints}"))?;
        let answer: Value = http
            .post(format!("{base}/api/v1/me/webhooks/{endpoint_id}/redeliver"))
            .bearer_auth(token)
            .json(&json!({"since": "2000-01-01T00:00:00Z", "until": "2100-01-01T00:00:00Z"}))
            .send()
            .await?
            .json()
            .await?;
        queued += answer["queued"].as_u64().context("queued")?;
    }
    loop {
        let done = acknowledged_total(&receiver)? - acknowledged_before;
        if done >= queued {
            break;
        }
        anyhow::ensure!(
            drain_started.elapsed() < Duration::from_secs(300),
            "the drain stalled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain = drain_started.elapsed();
    // The sender's pace, measured at the receiver as the bare loop's is below: from the first
    // attempt that reached it to the last acknowledgement (without the pause before the leader
    // looks: the redelivery was asked of another process).
    let (zhihui_acknowledged, zhihui_window) = pace(&receiver, drain_started)?;
    let zhihui_rate = zhihui_acknowledged as f64 / zhihui_window;
    println!(
        "drain: {queued} redeliveries asked, all acknowledged {:.2} s later; at the receiver {zhihui_acknowledged} acknowledged in {zhihui_window:.3} s",
        drain.as_secs_f64()
    );

    // The bare loop: the same bodies, signed, posted 16 at a time (zhihui's concurrency).
    let bodies: Vec<(String, Vec<u8>)> = pg
        .query(
            "SELECT message_id::text, payload::text FROM webhook_messages",
            &[],
        )
        .await?
        .iter()
        .map(|row| {
            (
                row.get::<_, String>(0),
                row.get::<_, String>(1).into_bytes(),
            )
        })
        .collect();
    let bare_started = Instant::now();
    let bare_count = bare_loop(&http, receiver_port, &bodies, &state).await?;
    let (bare_acknowledged, bare_window) = pace(&receiver, bare_started)?;
    anyhow::ensure!(
        bare_acknowledged == bare_count,
        "the receiver acknowledged {bare_acknowledged} of the bare loop's {bare_count} posts"
    );
    let bare_rate = bare_acknowledged as f64 / bare_window;
    println!(
        "sending pace, each from its first attempt at the receiver to its last acknowledgement: \
         zhihui {zhihui_rate:.0} deliveries/s (each signed, logged, rescheduled); a bare reqwest \
         loop of the same signed bodies to the same receiver: {bare_acknowledged} in \
         {bare_window:.3} s = {bare_rate:.0}/s"
    );
    figures.push(("webhooks_bare_loop".into(), bare_rate, "deliveries/s"));
    figures.push(("webhooks_deliveries".into(), zhihui_rate, "deliveries/s"));
    drop(cluster);
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(figures)
}

/// The deliveries acknowledged since `since` and the seconds from the first attempt that
/// arrived since then to the last acknowledgement: one window, the same for every sender.
fn pace(receiver: &Receiver, since: Instant) -> anyhow::Result<(usize, f64)> {
    let seen = receiver
        .seen
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    let first = seen.arrived_at.iter().filter(|at| **at >= since).min();
    let acknowledged: Vec<&Instant> = seen
        .acknowledged_at
        .iter()
        .filter(|at| **at >= since)
        .collect();
    let last = acknowledged.iter().max();
    let window = match (first, last) {
        (Some(first), Some(last)) => last.duration_since(*first).as_secs_f64(),
        _ => 0.0,
    };
    Ok((acknowledged.len(), window.max(1e-3)))
}

fn acknowledged_total(receiver: &Receiver) -> anyhow::Result<u64> {
    Ok(receiver
        .seen
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .acknowledged
        .values()
        .map(|count| u64::from(*count))
        .sum())
}

/// Post every body, signed with user 0's endpoint secret as zhihui would, 16 at a time.
async fn bare_loop(
    http: &reqwest::Client,
    port: u16,
    bodies: &[(String, Vec<u8>)],
    state: &zhihui::state::AppState,
) -> anyhow::Result<usize> {
    use futures::StreamExt;
    let endpoint = {
        let client = state.pg_pool.get().await?;
        client
            .query_one(
                "SELECT endpoint_id, generation FROM webhook_endpoints
                  WHERE url LIKE '%/hook/0'",
                &[],
            )
            .await?
    };
    let secret = state
        .webhooks
        .secret(endpoint.get(0), u32::try_from(endpoint.get::<_, i32>(1))?);
    let url = format!("http://127.0.0.1:{port}/hook/0");
    let results: Vec<bool> = futures::stream::iter(bodies.iter())
        .map(|(id, body)| {
            let timestamp = chrono::Utc::now().timestamp();
            let signature = zhihui::webhooks::signing::sign(&secret, id, timestamp, body);
            http.post(&url)
                .header("content-type", "application/json")
                .header("webhook-id", id.as_str())
                .header("webhook-timestamp", timestamp.to_string())
                .header("webhook-signature", signature)
                .body(body.clone())
                .send()
        })
        .buffer_unordered(16)
        .map(|result| result.is_ok_and(|response| response.status().is_success()))
        .collect()
        .await;
    Ok(results.into_iter().filter(|ok| *ok).count())
}
