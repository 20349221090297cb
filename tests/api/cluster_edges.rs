//! A Redis Cluster of the test's own that an operator grows and shrinks while zhihui works: a
//! fourth master is added, the queue's slot and a user's slot move to it and back, and the node
//! is removed (`redis-cli --cluster del-node` resets it and leaves it running, answering
//! CLUSTERDOWN for every slot). No answer is a 500, nothing is lost or doubled, and the slots
//! that moved back while zhihui was not looking are found again. And a master killed under every
//! money route: 503s with Retry-After, never a 500, and every retry under its idempotency key
//! lands once.

#![allow(clippy::unwrap_used)]
// The test reports what it counted (answers by status, the longest request) on stderr.
#![allow(clippy::print_stderr)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use secrecy::SecretString;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::edges::OwnRedis;
use crate::helpers::{TestApp, spawn_app_with};
use zhihui_domain::points::Points;

/// A port whose cluster bus (10000 above) is free too and below 65536.
fn cluster_port() -> u16 {
    loop {
        let port = 20_000 + (rand::random::<u16>() % 25_000);
        let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
}

async fn node(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/0"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn command<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> T {
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    command.query_async(&mut node(port).await).await.unwrap()
}

fn redis_cli(args: &[&str]) {
    let output = std::process::Command::new("redis-cli")
        .args(args)
        .output()
        .expect("redis-cli (scripts/services.sh installs it)");
    assert!(
        output.status.success(),
        "redis-cli {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Until every node in `ports` says the cluster is ok and knows `nodes` nodes.
async fn until_settled(ports: &[u16], nodes: usize) {
    let started = Instant::now();
    loop {
        let mut settled = true;
        for port in ports {
            let info: String = command(*port, &["CLUSTER", "INFO"]).await;
            let known: String = command(*port, &["CLUSTER", "NODES"]).await;
            settled &= info.contains("cluster_state:ok") && known.lines().count() == nodes;
        }
        if settled {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the cluster never settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Six nodes of the test's own under `directory` (three masters and a replica of each, started
/// with `extra` after [`CLUSTER_NODE`]), every replica synced with its master: their ports, the
/// nodes, and the seeds for `redis.cluster_nodes`.
async fn six_nodes(
    directory: &std::path::Path,
    extra: &[&str],
) -> (Vec<u16>, Vec<Option<OwnRedis>>, String) {
    let ports: Vec<u16> = (0..6).map(|_| cluster_port()).collect();
    let nodes: Vec<Option<OwnRedis>> = ports
        .iter()
        .map(|port| {
            let dir = directory.join(port.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            Some(OwnRedis::start_with(
                *port,
                &dir,
                &[CLUSTER_NODE, extra].concat(),
            ))
        })
        .collect();
    let address = |port: u16| format!("127.0.0.1:{port}");
    let mut create = vec!["--cluster".to_owned(), "create".to_owned()];
    create.extend(ports.iter().map(|port| address(*port)));
    create.extend([
        "--cluster-replicas".to_owned(),
        "1".to_owned(),
        "--cluster-yes".to_owned(),
    ]);
    redis_cli(&create.iter().map(String::as_str).collect::<Vec<_>>());
    until_settled(&ports, 6).await;
    // A replica that has not synced with its master yet could not take its place.
    let started = Instant::now();
    for port in &ports {
        loop {
            let role: String = command(*port, &["INFO", "replication"]).await;
            if role.contains("role:master") || role.contains("master_link_status:up") {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "a replica never synced"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let seeds = ports
        .iter()
        .map(|port| format!("redis://127.0.0.1:{port}"))
        .collect::<Vec<_>>()
        .join(",");
    (ports, nodes, seeds)
}

/// The port of the master that holds `key`'s slot, as the node on `port` knows it.
async fn master_of(port: u16, key: &str) -> u16 {
    let slot: u16 = command(port, &["CLUSTER", "KEYSLOT", key]).await;
    let nodes_text: String = command(port, &["CLUSTER", "NODES"]).await;
    nodes_text
        .lines()
        .find(|line| {
            line.contains("master")
                && line.split_whitespace().skip(8).any(|range| {
                    let (from, to) = range.split_once('-').unwrap_or((range, range));
                    from.parse::<u16>().is_ok_and(|from| from <= slot)
                        && to.parse::<u16>().is_ok_and(|to| slot <= to)
                })
        })
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|address| address.split('@').next())
        .and_then(|address| address.rsplit(':').next())
        .and_then(|port| port.parse::<u16>().ok())
        .unwrap()
}

/// The port of the replica of the master on `master`, as the node on `port` knows it.
async fn replica_of(port: u16, master: u16) -> u16 {
    let id: String = command(master, &["CLUSTER", "MYID"]).await;
    let nodes_text: String = command(port, &["CLUSTER", "NODES"]).await;
    nodes_text
        .lines()
        .find(|line| line.contains("slave") && line.split_whitespace().nth(3) == Some(id.as_str()))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|address| address.split('@').next())
        .and_then(|address| address.rsplit(':').next())
        .and_then(|port| port.parse::<u16>().ok())
        .unwrap()
}

/// Move `slot` from the master on `from` to the one on `to`, as `redis-cli --cluster reshard`
/// does: importing and migrating, the keys one batch at a time, then the slot's new owner
/// told to every master.
async fn move_slot(slot: u16, from: u16, to: u16, masters: &[u16]) {
    let slot = slot.to_string();
    let from_id: String = command(from, &["CLUSTER", "MYID"]).await;
    let to_id: String = command(to, &["CLUSTER", "MYID"]).await;
    let _: () = command(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]).await;
    let _: () = command(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]).await;
    loop {
        let keys: Vec<String> = command(from, &["CLUSTER", "GETKEYSINSLOT", &slot, "100"]).await;
        if keys.is_empty() {
            break;
        }
        let mut migrate = redis::cmd("MIGRATE");
        migrate
            .arg("127.0.0.1")
            .arg(to)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS")
            .arg(&keys);
        let _: () = migrate.query_async(&mut node(from).await).await.unwrap();
    }
    // The source first: once it holds no slot it may turn into a replica of the target (replica
    // migration), and a replica takes no SETSLOT; the others learn it by gossip if not from us.
    let _: () = command(from, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]).await;
    let _: () = command(to, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]).await;
    for other in masters.iter().filter(|port| ![from, to].contains(port)) {
        let mut setslot = redis::cmd("CLUSTER");
        setslot.arg("SETSLOT").arg(&slot).arg("NODE").arg(&to_id);
        let told: redis::RedisResult<()> = setslot.query_async(&mut node(*other).await).await;
        if let Err(error) = told {
            assert!(error.to_string().contains("only with masters"), "{error}");
        }
    }
}

/// The answers of one round of work, by status, and the longest request.
#[derive(Default, Debug)]
struct Answers {
    by_status: BTreeMap<u16, usize>,
    longest: Duration,
    longest_was: String,
}

impl Answers {
    /// `request` until it is answered other than 503 (at most 30 s), each answer counted.
    async fn until_done<F, Fut>(&mut self, what: &str, mut request: F) -> reqwest::Response
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = reqwest::Response>,
    {
        let started = Instant::now();
        loop {
            let sent = Instant::now();
            let response = request().await;
            let took = sent.elapsed();
            if took > self.longest {
                self.longest = took;
                self.longest_was = what.to_owned();
            }
            let status = response.status().as_u16();
            *self.by_status.entry(status).or_default() += 1;
            if status == 503 {
                eprintln!("{what}: 503 after {took:?}");
            }
            assert_ne!(status, 500, "{what}: {:?}", response.text().await);
            if status != 503 {
                return response;
            }
            assert!(
                response.headers().contains_key("retry-after"),
                "{what}: a 503 says when"
            );
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{what}: still 503 after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// One round of a user's work touching the queue's slot and the user's own: log in, cancel the
/// task the last round left queued (the first queue step after a slot moved is a removal),
/// submit another (retried under its idempotency key), read it and the account.
async fn work(
    app: &TestApp,
    username: &str,
    round: &str,
    queued: &mut Option<String>,
    answers: &mut Answers,
) {
    let credentials = json!({"username": username, "password": "a long password"});
    let login = answers
        .until_done("login", || {
            app.post("/api/v1/auth/login", None, &credentials)
        })
        .await;
    assert_eq!(login.status(), 200);
    let token = login.json::<Value>().await.unwrap()["token"]
        .as_str()
        .unwrap()
        .to_owned();
    if let Some(task) = queued.take() {
        let cancelled = answers
            .until_done("cancel", || async {
                app.http
                    .post(format!("{}/api/v1/tasks/{task}/cancel", app.address))
                    .bearer_auth(&token)
                    .send()
                    .await
                    .unwrap()
            })
            .await;
        assert_eq!(cancelled.status(), 200);
        assert_eq!(
            cancelled.json::<Value>().await.unwrap()["status"],
            "cancelled"
        );
    }
    if round.is_empty() {
        return;
    }
    let key = uuid::Uuid::now_v7().to_string();
    let submitted = answers
        .until_done("submit", || async {
            app.http
                .post(format!("{}/api/v1/tasks", app.address))
                .bearer_auth(&token)
                .header("Idempotency-Key", &key)
                .json(&json!({"prompt": format!("扩容那天的{round}：雨中的长城")}))
                .send()
                .await
                .unwrap()
        })
        .await;
    assert_eq!(submitted.status(), 201);
    let task = submitted.json::<Value>().await.unwrap()["task_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/api/v1/tasks/{task}");
    let read = answers
        .until_done("read the task", || app.get_as(&token, &path))
        .await;
    assert_eq!(read.status(), 200);
    let account = answers
        .until_done("read the account", || app.get_as(&token, "/api/v1/account"))
        .await;
    assert_eq!(account.status(), 200);
    *queued = Some(task);
}

const USERS: [&str; 2] = ["yunhai", "shanshui"];
/// A node of the test's own cluster (a node is taken for dead after 2 s).
const CLUSTER_NODE: &[&str] = &[
    "--cluster-enabled",
    "yes",
    "--cluster-config-file",
    "nodes.conf",
    "--cluster-node-timeout",
    "2000",
    "--appendonly",
    "no",
];
/// How long the load goes on after the node's removal.
const KEEP_WORKING: Duration = Duration::from_secs(60);

/// The operator's hold on the users' loops: rounds done, a pause, an end.
#[derive(Default)]
struct Control {
    rounds: [AtomicUsize; USERS.len()],
    idle: [AtomicBool; USERS.len()],
    paused: AtomicBool,
    stopped: AtomicBool,
}

impl Control {
    /// Until every user did `more` rounds after now.
    async fn until_rounds(&self, more: usize) {
        let from: Vec<usize> = self
            .rounds
            .iter()
            .map(|r| r.load(Ordering::SeqCst))
            .collect();
        while self
            .rounds
            .iter()
            .zip(&from)
            .any(|(rounds, from)| rounds.load(Ordering::SeqCst) < from + more)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Until no user has a request in flight.
    async fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        while !self.idle.iter().all(|idle| idle.load(Ordering::SeqCst)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

/// A user's rounds of work until stopped (a short breath between rounds: a steady load, not a
/// flood), then the last task cancelled. Its answers and the number of rounds (one task each).
async fn keep_working(
    app: &TestApp,
    username: &str,
    index: usize,
    control: &Control,
) -> (Answers, usize) {
    let mut answers = Answers::default();
    let mut queued = None;
    let mut round = 0;
    while !control.stopped.load(Ordering::SeqCst) {
        if control.paused.load(Ordering::SeqCst) {
            control.idle[index].store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        control.idle[index].store(false, Ordering::SeqCst);
        work(
            app,
            username,
            &format!("第{round}轮"),
            &mut queued,
            &mut answers,
        )
        .await;
        round += 1;
        control.rounds[index].fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    work(app, username, "", &mut queued, &mut answers).await;
    (answers, round)
}

#[tokio::test]
async fn a_cluster_grown_and_shrunk_under_load_answers_no_500_and_loses_nothing() {
    let directory = std::env::temp_dir().join(format!("zhihui-cluster-{}", uuid::Uuid::now_v7()));
    let ports: Vec<u16> = (0..4).map(|_| cluster_port()).collect();
    let _nodes: Vec<OwnRedis> = ports
        .iter()
        .map(|port| {
            let dir = directory.join(port.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            OwnRedis::start_with(*port, &dir, CLUSTER_NODE)
        })
        .collect();
    let address = |port: u16| format!("127.0.0.1:{port}");
    let (first, masters, added) = (ports[0], ports[..3].to_vec(), ports[3]);
    let mut create = vec!["--cluster".to_owned(), "create".to_owned()];
    create.extend(masters.iter().map(|port| address(*port)));
    create.extend(["--cluster-yes".to_owned()]);
    redis_cli(&create.iter().map(String::as_str).collect::<Vec<_>>());
    until_settled(&masters, 3).await;
    redis_cli(&["--cluster", "add-node", &address(added), &address(first)]);
    until_settled(&ports, 4).await;

    let seeds = masters
        .iter()
        .map(|port| format!("redis://127.0.0.1:{port}"))
        .collect::<Vec<_>>()
        .join(",");
    let app = spawn_app_with(|settings| {
        settings.redis.cluster_nodes = SecretString::from(seeds);
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
    })
    .await;
    let admin = app.admin_token("operator").await;
    let mut users = Vec::new();
    for username in USERS {
        let user = app.register(username, "a long password").await;
        let granted = app
            .post(
                &format!("/api/v1/admin/accounts/{user}/grants"),
                Some(&admin),
                &json!({"amount": "10", "reason": "扩容测试"}),
            )
            .await;
        assert_eq!(granted.status(), 201);
        users.push(user);
    }

    // Where the slots live: `redis-cli --cluster create` gives three masters even ranges.
    let owner = |slot: u16| masters[usize::from(slot / 5461).min(2)];
    let queue_slot: u16 = command(first, &["CLUSTER", "KEYSLOT", "queue"]).await;
    let user_slot: u16 = command(first, &["CLUSTER", "KEYSLOT", &format!("u:{}", users[0])]).await;
    let control = Control::default();
    let services = app.services_on_app_clock();
    let operator = async {
        control.until_rounds(1).await;
        // Grown, under the load: the queue's slot, then the first user's, to the new master.
        move_slot(queue_slot, owner(queue_slot), added, &ports).await;
        control.until_rounds(2).await;
        if user_slot != queue_slot {
            move_slot(user_slot, owner(user_slot), added, &ports).await;
        }
        control.until_rounds(2).await;
        // The queue's slot back, under the load.
        move_slot(queue_slot, added, owner(queue_slot), &ports).await;
        control.until_rounds(2).await;
        // The load pauses: every cancel while the slots moved finished in its own request (a
        // transaction would have been aborted by MOVED and its queue step left to the sweeper).
        control.pause().await;
        app.clock.advance(Duration::from_millis(
            app.settings.tasks.intent_resolve_after_ms + 1,
        ));
        assert_eq!(
            services.tasks.sweep_once().await.unwrap().intents_resolved,
            0
        );
        // The user's slot back and the node removed while zhihui does not ask: its map still
        // points that slot at the node that now answers CLUSTERDOWN.
        if user_slot != queue_slot {
            move_slot(user_slot, added, owner(user_slot), &ports).await;
        }
        let added_id: String = command(added, &["CLUSTER", "MYID"]).await;
        redis_cli(&["--cluster", "del-node", &address(first), &added_id]);
        until_settled(&masters, 3).await;
        let removed = Instant::now();
        control.resume();
        // A minute of work after the removal.
        control.until_rounds(3).await;
        while removed.elapsed() < KEEP_WORKING {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        control.stop();
    };
    let (_, loads) = tokio::join!(
        operator,
        futures::future::join_all(
            USERS
                .iter()
                .enumerate()
                .map(|(index, username)| keep_working(&app, username, index, &control))
        )
    );

    let mut answers = Answers::default();
    let mut rounds = 0;
    for (load, done) in loads {
        for (status, count) in load.by_status {
            *answers.by_status.entry(status).or_default() += count;
        }
        if load.longest > answers.longest {
            answers.longest = load.longest;
            answers.longest_was = load.longest_was;
        }
        rounds += done;
    }
    eprintln!(
        "answers by status {:?} in {rounds} rounds of {} users; longest request {:?} ({})",
        answers.by_status,
        USERS.len(),
        answers.longest,
        answers.longest_was
    );
    assert!(!answers.by_status.contains_key(&500));
    // Nothing lost or doubled: every task submitted was cancelled and every point is back.
    app.clock.advance(Duration::from_millis(
        app.settings.tasks.intent_resolve_after_ms + 1,
    ));
    let swept = app
        .services_on_app_clock()
        .tasks
        .sweep_once()
        .await
        .unwrap()
        .intents_resolved;
    eprintln!("cancels finished by the sweeper: {swept}");
    app.project().await;
    let mut tasks_seen = 0;
    for (username, user) in USERS.iter().zip(&users) {
        let account = crate::tasks::account_of(&app, user).await;
        assert_eq!(account.balance.available, Points::whole(10), "{username}");
        assert_eq!(account.balance.frozen, Points::whole(0), "{username}");
        let token = app.login(username, "a long password").await;
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(cursor) => format!("/api/v1/tasks?limit=100&cursor={cursor}"),
                None => "/api/v1/tasks?limit=100".to_owned(),
            };
            let page: Value = app.get_as(&token, &path).await.json().await.unwrap();
            for task in page["tasks"].as_array().unwrap() {
                assert_eq!(task["status"], "cancelled", "{task}");
                tasks_seen += 1;
            }
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
    }
    assert_eq!(tasks_seen, rounds, "one task a round");
    assert_eq!(app.services().tasks.queue.len().await.unwrap(), 0);
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
    let _ = std::fs::remove_dir_all(&directory);
}

/// A request sent again under the same idempotency key while it answers 503: the answers,
/// counted, and the last (never a 503, within 30 s).
async fn until_answered<F, Fut>(answers: &mut Answers, what: &str, request: F) -> (u16, Value)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = reqwest::Response>,
{
    let response = answers.until_done(what, request).await;
    let status = response.status().as_u16();
    let body = response.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

/// A POST with a bearer token, a JSON body and an idempotency key.
async fn keyed_post(
    app: &TestApp,
    token: &str,
    path: String,
    key: &str,
    body: Value,
) -> reqwest::Response {
    app.http
        .post(format!("{}{path}", app.address))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// What one user's money rounds met, beside the answers.
#[derive(Default)]
struct Spent {
    granted: u32,
    redeemed: u32,
    claims: u32,
    prioritised: u32,
}

/// One round of every money route, through `app`: a grant (the admin's), two tasks submitted,
/// the second prioritised, both cancelled, a code redeemed, a promotion claimed. Each retried
/// under its idempotency key while it answers 503; every final answer is a success or a named
/// outcome.
#[allow(clippy::too_many_arguments)]
async fn money_round(
    app: &TestApp,
    admin: &str,
    user: &str,
    token: &str,
    code: &str,
    promotion: Uuid,
    answers: &mut Answers,
    spent: &mut Spent,
) {
    let key = || Uuid::now_v7().to_string();
    let grant_key = key();
    let (status, _) = until_answered(answers, "grant", || {
        keyed_post(
            app,
            admin,
            format!("/api/v1/admin/accounts/{user}/grants"),
            &grant_key,
            json!({"amount": "10", "reason": "主节点宕机演练"}),
        )
    })
    .await;
    assert_eq!(status, 201, "grant");
    spent.granted += 10;
    let mut tasks = Vec::new();
    for prompt in ["雨夜的霓虹街道", "清晨的稻田"] {
        let submit_key = key();
        let (status, body) = until_answered(answers, "submit", || {
            keyed_post(
                app,
                token,
                "/api/v1/tasks".into(),
                &submit_key,
                json!({"prompt": prompt}),
            )
        })
        .await;
        assert_eq!(status, 201, "submit: {body}");
        tasks.push(body["task_id"].as_str().unwrap().to_owned());
    }
    let prioritise_key = key();
    let (status, body) = until_answered(answers, "prioritise", || {
        keyed_post(
            app,
            token,
            format!("/api/v1/tasks/{}/prioritise", tasks[1]),
            &prioritise_key,
            json!({}),
        )
    })
    .await;
    match status {
        200 => spent.prioritised += u32::from(body["charged_now"] == true),
        409 => assert_eq!(body["type"], "/problems/already-first", "{body}"),
        other => panic!("prioritise answered {other}: {body}"),
    }
    for task in &tasks {
        let cancel_key = key();
        let (status, body) = until_answered(answers, "cancel", || {
            keyed_post(
                app,
                token,
                format!("/api/v1/tasks/{task}/cancel"),
                &cancel_key,
                json!({}),
            )
        })
        .await;
        assert_eq!(
            (status, body["status"].as_str()),
            (200, Some("cancelled")),
            "cancel: {body}"
        );
    }
    let redeem_key = key();
    let (status, body) = until_answered(answers, "redeem", || {
        keyed_post(
            app,
            token,
            "/api/v1/codes/redeem".into(),
            &redeem_key,
            json!({"code": code}),
        )
    })
    .await;
    assert_eq!(status, 200, "redeem: {body}");
    spent.redeemed += 1;
    let claim_key = key();
    let (status, body) = until_answered(answers, "claim", || {
        keyed_post(
            app,
            token,
            format!("/api/v1/promotions/{promotion}/claims"),
            &claim_key,
            json!({}),
        )
    })
    .await;
    match status {
        202 => spent.claims += 1,
        409 => assert_eq!(body["type"], "/problems/already-claimed", "{body}"),
        other => panic!("claim answered {other}: {body}"),
    }
}

/// The master holding the queue (and the dispatcher's keys) is SIGKILLed while two users go
/// through every money route, one request through each of two instances in turn: its replica
/// is promoted by the cluster, and in between each route answers 503 with Retry-After, never a
/// 500; each is sent again under its idempotency key until it succeeds or names its outcome.
/// Then nothing lost or doubled: every code credited once, every task cancelled with its points
/// back, every balance equal to its events (`audit verify`).
#[tokio::test]
async fn a_killed_master_under_every_money_route_answers_503_never_500_and_retries_land_once() {
    let directory =
        std::env::temp_dir().join(format!("zhihui-cluster-kill-{}", uuid::Uuid::now_v7()));
    let (ports, mut nodes, seeds) = six_nodes(&directory, &[]).await;
    let app = spawn_app_with(|settings| {
        settings.redis.cluster_nodes = SecretString::from(seeds);
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
        settings.codes.page_size = 50;
    })
    .await;
    let second = app.another_instance().await;
    let admin = app.admin_token("operator").await;

    // Codes (issued by the generator, read from the export) and promotions, before the load.
    const ROUNDS_MAX: usize = 200;
    let now = app.clock.now();
    let (_, codes) = crate::redeem::issued_batch(
        &app,
        &admin,
        u32::try_from(2 * ROUNDS_MAX).unwrap(),
        "2",
        (
            now - chrono::Duration::hours(1),
            now + chrono::Duration::hours(24),
        ),
    )
    .await;
    let codes: Vec<String> = codes.into_iter().map(|(_, code)| code).collect();
    let mut promotions = Vec::new();
    for n in 0..8 {
        let created = app
            .post(
                "/api/v1/admin/promotions",
                Some(&admin),
                &json!({"title": format!("限时礼包{n}"), "points": "5", "price": "1", "stock": 1000,
                        "starts_at": now - chrono::Duration::hours(1), "ends_at": now + chrono::Duration::hours(24)}),
            )
            .await;
        assert_eq!(created.status(), 201);
        let created: Value = created.json().await.unwrap();
        promotions.push(Uuid::parse_str(created["promotion_id"].as_str().unwrap()).unwrap());
    }
    let mut users = Vec::new();
    for username in USERS {
        let user = app.register(username, "a long password").await;
        let token = app.login(username, "a long password").await;
        users.push((user, token));
    }

    // The master of the queue's slot, and the load around its death.
    let victim = master_of(ports[0], "queue").await;
    let codes_per_user: Vec<Vec<String>> =
        codes.chunks(ROUNDS_MAX).map(<[String]>::to_vec).collect();
    let control = Control::default();
    let operator = async {
        control.until_rounds(2).await;
        let index = ports.iter().position(|port| *port == victim).unwrap();
        drop(nodes[index].take());
        let killed = Instant::now();
        let survivors: Vec<u16> = ports
            .iter()
            .copied()
            .filter(|port| *port != victim)
            .collect();
        until_failed_over(&survivors, victim).await;
        let promoted = killed.elapsed();
        control.until_rounds(10).await;
        control.stop();
        promoted
    };
    let loads =
        futures::future::join_all(users.iter().enumerate().map(|(index, (user, token))| {
            let (control, admin, codes, promotions) =
                (&control, &admin, &codes_per_user[index], &promotions);
            let instances = [&app, &second];
            async move {
                let mut answers = Answers::default();
                let mut spent = Spent::default();
                let mut round = 0;
                while !control.stopped.load(Ordering::SeqCst) && round < codes.len() {
                    money_round(
                        instances[round % 2],
                        admin,
                        user,
                        token,
                        &codes[round],
                        promotions[round % promotions.len()],
                        &mut answers,
                        &mut spent,
                    )
                    .await;
                    round += 1;
                    control.rounds[index].fetch_add(1, Ordering::SeqCst);
                }
                (answers, spent, round)
            }
        }));
    let (promoted, loads) = tokio::join!(operator, loads);

    let mut answers = Answers::default();
    let mut rounds = 0;
    for (load, _, done) in &loads {
        for (status, count) in &load.by_status {
            *answers.by_status.entry(*status).or_default() += count;
        }
        if load.longest > answers.longest {
            answers.longest = load.longest;
            answers.longest_was = load.longest_was.clone();
        }
        rounds += done;
    }
    eprintln!(
        "master of the queue's slot killed, its replica promoted after {promoted:?}; answers by status {:?} in {rounds} money rounds; longest request {:?} ({})",
        answers.by_status, answers.longest, answers.longest_was
    );
    assert!(!answers.by_status.contains_key(&500));
    // Nothing lost or doubled: each retried grant landed once, each code once, every task
    // cancelled with its points back, the claims persisted, every balance equal to its events.
    let services = app.services_on_app_clock();
    crate::promotions::consume_all(&[&app, &second]).await;
    app.clock.advance(Duration::from_millis(
        app.settings.tasks.intent_resolve_after_ms + 1,
    ));
    services.tasks.sweep_once().await.unwrap();
    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    for ((user, _), (_, spent, done)) in users.iter().zip(&loads) {
        let account = crate::tasks::account_of(&app, user).await;
        assert_eq!(account.balance.frozen, Points::ZERO, "{user}");
        let grants: i64 = client
            .query_one(
                "SELECT count(*) FROM events WHERE stream_id = 'account-' || $1 AND event_type = 'PointsGranted'",
                &[user],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            grants,
            i64::try_from(*done).unwrap(),
            "one grant a round, retries included"
        );
        assert_eq!(spent.granted, 10 * u32::try_from(*done).unwrap());
        assert_eq!(spent.redeemed, u32::try_from(*done).unwrap());
        eprintln!(
            "{user}: {done} rounds, {} prioritised with a fee, {} claims accepted",
            spent.prioritised, spent.claims
        );
    }
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
    drop(nodes);
    let _ = std::fs::remove_dir_all(&directory);
}

/// Until the survivors say the cluster is ok and one of them took the dead node's place.
async fn until_failed_over(survivors: &[u16], dead: u16) {
    let started = Instant::now();
    loop {
        let mut ok = true;
        for port in survivors {
            let info: String = command(*port, &["CLUSTER", "INFO"]).await;
            ok &= info.contains("cluster_state:ok");
        }
        let known: String = command(survivors[0], &["CLUSTER", "NODES"]).await;
        let dead_failed = known
            .lines()
            .any(|line| line.contains(&format!(":{dead}@")) && line.contains("fail"));
        if ok && dead_failed {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the cluster never failed over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Nodes that keep every write they took on disk, and a replica promoted however far behind.
const LOSSY_FAILOVER: &[&str] = &[
    "--appendonly",
    "yes",
    "--appendfsync",
    "always",
    "--cluster-replica-validity-factor",
    "0",
];

/// In a cluster the gallery's progress (`{gallery}`) and a work's like set live on different
/// masters. The work's master dies after taking likes its replica never received (the replica
/// was down, and comes back from its own disk after the master died), and the replica is
/// promoted: the like set lacks them while the progress, on a master that lost nothing, says
/// they are applied. The worker sees other masters' replication ids than its progress was
/// checked against and applies the log again: every like comes back.
#[tokio::test]
async fn likes_a_promoted_replica_never_received_come_back_though_the_gallerys_progress_survived() {
    use crate::gallery::{
        gallery_harness, gallery_worker, json_of, member, publish, send, succeeded_tasks,
    };
    let directory =
        std::env::temp_dir().join(format!("zhihui-cluster-lost-{}", uuid::Uuid::now_v7()));
    let (ports, mut nodes, seeds) = six_nodes(&directory, LOSSY_FAILOVER).await;
    let harness = gallery_harness(move |settings| {
        settings.redis.cluster_nodes = SecretString::from(seeds);
    })
    .await;
    let app = &harness.app;
    let second = app.another_instance().await;
    let (_, creator) = crate::tasks::funded_user(app, "huajia", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    let work = publish(app, &creator, &tasks[0], "主节点丢了点赞", true).await;
    // The fans' sessions are made while every node is up (and on disk).
    let mut fans = Vec::new();
    for index in 0..6 {
        fans.push(member(app, &format!("fensi{index}")).await.1);
    }
    gallery_worker(app).catch_up().await.unwrap();

    // The work's master, and the gallery's progress on another one.
    let victim = master_of(ports[0], &format!("{{w:{work}}}")).await;
    let progress = master_of(ports[0], "{gallery}").await;
    if progress == victim {
        let known: String = command(ports[0], &["CLUSTER", "NODES"]).await;
        let masters: Vec<u16> = known
            .lines()
            .filter(|line| line.contains("master"))
            .filter_map(|line| line.split_whitespace().nth(1))
            .filter_map(|address| address.split('@').next()?.rsplit(':').next()?.parse().ok())
            .collect();
        let other = *masters.iter().find(|port| **port != victim).unwrap();
        let slot: u16 = command(ports[0], &["CLUSTER", "KEYSLOT", "{gallery}"]).await;
        move_slot(slot, victim, other, &masters).await;
    }
    assert_ne!(master_of(ports[0], "{gallery}").await, victim);
    let replica = replica_of(ports[0], victim).await;
    let index_of = |port: u16| ports.iter().position(|p| *p == port).unwrap();

    // The replica goes down; six fans like the work through both processes, and the worker
    // applies the likes (its progress moves on, on the other master).
    drop(nodes[index_of(replica)].take());
    let path = format!("/api/v1/gallery/works/{work}");
    for (index, fan) in fans.iter().enumerate() {
        let process = if index % 2 == 0 { app } else { &second };
        let like = send(process, reqwest::Method::PUT, &format!("{path}/like"), fan).await;
        assert_eq!(json_of(like).await["likes"], index + 1);
    }
    gallery_worker(app).catch_up().await.unwrap();

    // The master dies; the replica comes back from its own disk and is promoted in its place.
    drop(nodes[index_of(victim)].take());
    let replica_dir = directory.join(replica.to_string());
    nodes[index_of(replica)] = Some(OwnRedis::start_with(
        replica,
        &replica_dir,
        &[CLUSTER_NODE, LOSSY_FAILOVER].concat(),
    ));
    let survivors: Vec<u16> = ports.iter().copied().filter(|p| *p != victim).collect();
    until_failed_over(&survivors, victim).await;

    // A process that never saw the old master: the likes are gone from Redis.
    let promoted = app.another_instance().await;
    let mut answers = Answers::default();
    let lost = answers
        .until_done("read the work", || promoted.get_as(&fans[0], &path))
        .await;
    let lost = json_of(lost).await;
    assert_eq!(
        lost["likes"], 0,
        "the promoted replica lost nothing? {lost}"
    );

    // The worker sees other masters and applies the log again.
    let worker = gallery_worker(&promoted);
    assert!(worker.check_masters().await.unwrap());
    worker.catch_up().await.unwrap();
    assert!(!worker.check_masters().await.unwrap());
    for fan in &fans {
        let view = json_of(promoted.get_as(fan, &path).await).await;
        assert_eq!(view["likes"], 6, "{view}");
        assert_eq!(view["liked"], true, "{view}");
        assert_eq!(view["first_likers"].as_array().unwrap().len(), 5);
    }
    assert!(!answers.by_status.contains_key(&500));
    app.project().await;
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
    drop(nodes);
    let _ = std::fs::remove_dir_all(&directory);
}
