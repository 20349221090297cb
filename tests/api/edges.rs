//! The edges of the HTTP API and of its services: no request gets a 500 for a value it chose (a
//! cursor far outside time), a body over the limit is a 413, and a Redis restarted with the
//! repository's configuration keeps every session.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{Value, json};

use crate::helpers::spawn_app_with;

#[tokio::test]
async fn a_cursor_far_outside_time_is_a_422_naming_it_not_a_500() {
    let app = spawn_app_with(|_| {}).await;
    app.register("alice", "a long password").await;
    let token = app.login("alice", "a long password").await;
    for cursor in [
        // PostgreSQL: timestamp out of range (the fuzzer's find).
        "-1000000000000000000_00000000-0000-0000-0000-000000000000",
        "9000000000000000000_00000000-0000-0000-0000-000000000000",
        "99999999999999999999_00000000-0000-0000-0000-000000000000",
        "1_not-a-uuid",
        "no-underscore",
    ] {
        let response = app
            .get_as(&token, &format!("/api/v1/tasks?cursor={cursor}"))
            .await;
        assert_eq!(response.status(), 422, "{cursor}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], "cursor", "{cursor}");
    }
    // Cursors this API could have returned still page.
    let response = app
        .get_as(
            &token,
            "/api/v1/tasks?cursor=0_00000000-0000-0000-0000-000000000000",
        )
        .await;
    assert_eq!(response.status(), 200);
    for cursor in ["-5", "9223372036854775807", "abc"] {
        let response = app
            .get_as(&token, &format!("/api/v1/account/ledger?cursor={cursor}"))
            .await;
        assert!(
            response.status() == 200 || response.status() == 422,
            "{cursor}: {}",
            response.status()
        );
    }
}

#[tokio::test]
async fn a_body_over_the_limit_is_a_413_not_a_422() {
    let app = spawn_app_with(|_| {}).await;
    let padding = "x".repeat(zhihui::http::JSON_BODY_BYTES_MAX);
    let response = app
        .post(
            "/api/v1/auth/login",
            None,
            &json!({"username": "alice", "password": padding}),
        )
        .await;
    assert_eq!(response.status(), 413);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/body-too-large");
}

/// A body must be a JSON object: serde would read a struct's fields from an array by position.
/// Whitespace before the object is still JSON; a syntax error names where it is.
#[tokio::test]
async fn a_body_that_is_not_a_json_object_is_a_422_naming_the_body() {
    let app = spawn_app_with(|_| {}).await;
    let token = app.admin_token("guanliyuan").await;
    let raw = |body: &'static str| {
        app.http
            .post(format!("{}/api/v1/tasks", app.address))
            .bearer_auth(&token)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for body in [
        // Every field of a submit, by position: serde alone would take it.
        r#"["一只猫", null, 1, null, null, null, null, null, null, null]"#,
        r#"["一只猫", 1]"#,
        r#""一只猫""#,
        "42",
        "null",
        r#"{"prompt": "一只猫""#,
    ] {
        let response = raw(body).await.unwrap();
        assert_eq!(response.status(), 422, "{body}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(
            (problem["field"].as_str(), problem["rule"].as_str()),
            (Some("body"), Some("unreadable")),
            "{body}: {problem}"
        );
    }
    let object = raw(" \n\t{\"prompt\": \"一只猫\", \"colour\": \"红\"}")
        .await
        .unwrap();
    let problem: Value = object.json().await.unwrap();
    assert_eq!(
        problem["field"], "colour",
        "the object was read, its unknown field named: {problem}"
    );
    // A field's value of the wrong kind names the field, not the body.
    let problem: Value = raw(r#"{"prompt": "一只猫", "steps": "很多"}"#)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(problem["field"], "steps", "{problem}");
}

/// A misspelt field is refused by name, not dropped: an admin's grant with `resaon` would
/// otherwise be refused for a missing reason, and an optional field spelt wrong would be lost.
#[tokio::test]
async fn an_unknown_body_field_is_a_422_naming_it_on_every_route() {
    let app = spawn_app_with(|_| {}).await;
    let admin = app.admin_token("guanliyuan").await;
    let user = app.register("xiaoming", "correct horse").await;
    for (path, body, field) in [
        (
            format!("/api/v1/admin/accounts/{user}/grants"),
            json!({"amount": "1", "reason": "活动奖励", "nte": "备注"}),
            "nte",
        ),
        (
            format!("/api/v1/admin/users/{user}/role"),
            json!({"role": "admin", "extra": 1}),
            "extra",
        ),
        (
            "/api/v1/auth/login".to_owned(),
            json!({"username": "xiaoming", "password": "correct horse", "remember": true}),
            "remember",
        ),
    ] {
        let response = if path.ends_with("/role") {
            app.put(&path, Some(&admin), &body).await
        } else {
            app.post(&path, Some(&admin), &body).await
        };
        assert_eq!(response.status(), 422, "{path}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], field, "{path}: {problem}");
    }
}

/// A query parameter that cannot be read is named, as a body's field is: the parameter given
/// a value of the wrong kind, or given twice. A stranger is refused before being told.
#[tokio::test]
async fn a_query_parameter_that_cannot_be_read_is_a_422_naming_it() {
    let app = spawn_app_with(|_| {}).await;
    let token = app.admin_token("guanliyuan").await;
    for query in [
        "limit=garbage",
        "limit=1e308",
        "limit=9223372036854775808",
        "limit=",
        "limit=1&limit=2",
        "limit=-1",
    ] {
        let response = app.get_as(&token, &format!("/api/v1/tasks?{query}")).await;
        assert_eq!(response.status(), 422, "{query}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], "limit", "{query}: {problem}");
    }
    let problem: Value = app
        .get_as(&token, "/api/v1/account/ledger?cursor=1&cursor=2")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(problem["field"], "cursor", "{problem}");
    assert_eq!(app.get("/api/v1/tasks?limit=garbage").await.status(), 401);
}

/// A Redis server of this test's own, started with `scripts/redis.conf` in a fresh directory.
pub(crate) struct OwnRedis {
    pub(crate) child: std::process::Child,
    port: u16,
    directory: std::path::PathBuf,
}

impl OwnRedis {
    fn start(port: u16, directory: &std::path::Path) -> OwnRedis {
        OwnRedis::start_with(port, directory, &[])
    }

    pub(crate) fn start_with(port: u16, directory: &std::path::Path, extra: &[&str]) -> OwnRedis {
        let child = std::process::Command::new("redis-server")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/redis.conf"))
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(directory)
            .args(extra)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (scripts/services.sh installs it)");
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "redis never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        OwnRedis {
            child,
            port,
            directory: directory.to_owned(),
        }
    }

    /// `SHUTDOWN` (as a service manager stops it), then wait for the process to end.
    async fn stop(mut self) -> std::path::PathBuf {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}/0", self.port)).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        let _: redis::RedisResult<()> = redis::cmd("SHUTDOWN").query_async(&mut connection).await;
        self.child.wait().unwrap();
        self.directory.clone()
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An app on a Redis of the test's own (started in a fresh directory), with a cheap password
/// hash: the Redis, its port, its directory and the app.
async fn app_on_own_redis(
    customise: impl FnOnce(&mut zhihui::platform::configuration::Settings),
) -> (OwnRedis, u16, std::path::PathBuf, crate::helpers::TestApp) {
    let port = crate::helpers::free_port();
    let directory = std::env::temp_dir().join(format!("zhihui-redis-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&directory).unwrap();
    let redis = OwnRedis::start(port, &directory);
    let app = spawn_app_with(|settings| {
        crate::helpers::one_redis_at(settings, format!("redis://127.0.0.1:{port}/0"));
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
        customise(settings);
    })
    .await;
    (redis, port, directory, app)
}

/// `INFO replication` of the Redis on `port`, as `field:value` lines.
async fn replication_info(port: u16) -> String {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut connection)
        .await
        .unwrap()
}

/// A Redis master dies and its replica is promoted. Replication is
/// asynchronous, so what the replica had not received is gone; a revocation must not be among
/// it. With `redis.revocation_replicas` = 1 a logout is answered 204 only once the replica holds
/// it: that logout stays done on the promoted replica. A logout made while the replica lags
/// (here: stopped) is answered 503 `redis-replicas` (without the wait it would have said 204):
/// whether the replica got it is unknown (bytes may wait in its socket), and logging out again
/// on the promoted replica finishes it.
#[tokio::test]
async fn a_logout_answered_done_survives_a_redis_failover_and_one_that_could_not_be_is_not_answered_done()
 {
    let (master_port, replica_port) = (crate::helpers::free_port(), crate::helpers::free_port());
    let directory = std::env::temp_dir().join(format!("zhihui-failover-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(directory.join("master")).unwrap();
    std::fs::create_dir_all(directory.join("replica")).unwrap();
    let mut master = OwnRedis::start(master_port, &directory.join("master"));
    let replica = OwnRedis::start_with(
        replica_port,
        &directory.join("replica"),
        &["--replicaof", "127.0.0.1", &master_port.to_string()],
    );
    let started = std::time::Instant::now();
    while !replication_info(replica_port)
        .await
        .contains("master_link_status:up")
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the replica never synced"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let app = spawn_app_with(|settings| {
        crate::helpers::one_redis_at(settings, format!("redis://127.0.0.1:{master_port}/0"));
        settings.redis.revocation_replicas = 1;
        settings.redis.revocation_wait_ms = 300;
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
    })
    .await;
    app.register("xiaoli", "a long password").await;
    app.register("xiaowang", "a long password").await;
    let done = app.login("xiaoli", "a long password").await;
    let pending = app.login("xiaowang", "a long password").await;

    // The replica keeps up: the logout is answered once it holds it.
    assert_eq!(
        app.post("/api/v1/auth/logout", Some(&done), &json!({}))
            .await
            .status(),
        204
    );
    // The replica stops answering (a slow link, a busy replica): the logout cannot be confirmed.
    let replica_pid = replica.child.id().to_string();
    let signal = |name: &str| {
        assert!(
            std::process::Command::new("kill")
                .args([name, &replica_pid])
                .status()
                .unwrap()
                .success()
        );
    };
    signal("-STOP");
    let refused = app
        .post("/api/v1/auth/logout", Some(&pending), &json!({}))
        .await;
    assert_eq!(refused.status(), 503);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(
        problem["dependencies"],
        json!(["redis-replicas"]),
        "{problem}"
    );

    // The master dies with SIGKILL; the replica resumes and is promoted.
    master.child.kill().unwrap();
    master.child.wait().unwrap();
    signal("-CONT");
    let client = redis::Client::open(format!("redis://127.0.0.1:{replica_port}/0")).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut connection)
        .await
        .unwrap();
    let promoted = app
        .another_instance_with(|settings| {
            crate::helpers::one_redis_at(settings, format!("redis://127.0.0.1:{replica_port}/0"));
            // The promoted replica has no replica of its own yet.
            settings.redis.revocation_replicas = 0;
        })
        .await;
    assert_eq!(promoted.get_as(&done, "/api/v1/me").await.status(), 401);
    // Logging out again is the user's way to finish the unconfirmed one (already done: 401).
    match promoted
        .get_as(&pending, "/api/v1/me")
        .await
        .status()
        .as_u16()
    {
        200 => assert_eq!(
            promoted
                .post("/api/v1/auth/logout", Some(&pending), &json!({}))
                .await
                .status(),
            204
        ),
        401 => {}
        other => panic!("the unconfirmed session answered {other}"),
    }
    assert_eq!(promoted.get_as(&pending, "/api/v1/me").await.status(), 401);
    drop(replica);
    let _ = std::fs::remove_dir_all(&directory);
}

#[tokio::test]
async fn a_redis_restarted_with_the_repositorys_configuration_keeps_every_session() {
    let (redis, port, _, app) = app_on_own_redis(|_| {}).await;
    app.register("bob", "a long password").await;
    let token = app.login("bob", "a long password").await;
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 200);

    let directory = redis.stop().await;
    let _restarted = OwnRedis::start(port, &directory);
    // The session made before the restart still works (the connection comes back by itself).
    let started = std::time::Instant::now();
    loop {
        let status = app.get_as(&token, "/api/v1/me").await.status();
        if status == 200 {
            break;
        }
        assert!(
            status == 503 && started.elapsed() < Duration::from_secs(20),
            "after the restart: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = std::fs::remove_dir_all(&directory);
}

/// A Redis that restarted (or failed over to a replica) may lack its last writes while looking
/// complete: a task queued in its last moment is missing from the queue, and nothing looks
/// flushed. The dispatcher leader's renewal compares the replication id of the Redis holding the
/// queue with the one its term began on; another one ends the term (the lease is still ours, so
/// only that check can end it), and the next term rebuilds the queue from the events.
#[tokio::test]
async fn a_leader_whose_redis_restarted_ends_its_term_so_the_next_one_rebuilds_the_queue() {
    let (redis, port, _, app) = app_on_own_redis(|_| {}).await;
    let services = app.services();
    let leases = services.dispatcher.leases();
    let term = leases
        .acquire("restart-test", 600_000)
        .await
        .unwrap()
        .expect("nobody else leads");
    assert!(term.redis_replication_id.is_some());
    assert!(
        leases.renew(&term, 600_000).await.unwrap(),
        "the same Redis"
    );

    let directory = redis.stop().await;
    let _restarted = OwnRedis::start(port, &directory);
    let started = std::time::Instant::now();
    let renewed = loop {
        match leases.renew(&term, 600_000).await {
            Ok(renewed) => break renewed,
            Err(_) if started.elapsed() < Duration::from_secs(20) => tokio::task::yield_now().await,
            Err(error) => panic!("Redis never came back: {error:#}"),
        }
    };
    assert!(!renewed, "a renewal on a restarted Redis ends the term");
    assert_eq!(
        leases.holder().await.unwrap(),
        Some(term.value()),
        "the lease survived the restart: the replication id ended the term"
    );
    // The term ends as a lost one does (it resigns); the next one starts on the new Redis.
    leases.resign(&term).await.unwrap();
    let next = leases
        .acquire("restart-test", 600_000)
        .await
        .unwrap()
        .expect("the lease is free");
    assert_ne!(next.redis_replication_id, term.redis_replication_id);
    assert!(leases.renew(&next, 600_000).await.unwrap());
    let _ = std::fs::remove_dir_all(&directory);
}

/// A hostile image server's `/view`: an endless body, HTML sent as a PNG, a JPEG sent as HTML, a
/// declared length over the cap.
async fn hostile_view_server() -> String {
    use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = HttpServer::new(|| {
        App::new().route(
            "/view",
            web::get().to(|request: HttpRequest| async move {
                let query = request.query_string().to_owned();
                if query.contains("endless") {
                    let chunks = futures::stream::repeat_with(|| {
                        Ok::<_, std::io::Error>(web::Bytes::from(vec![0u8; 64 * 1024]))
                    });
                    HttpResponse::Ok()
                        .content_type("image/png")
                        .streaming(chunks)
                } else if query.contains("html") {
                    HttpResponse::Ok()
                        .content_type("image/png")
                        .body("<html><script>alert(1)</script></html>")
                } else if query.contains("jpeg") {
                    HttpResponse::Ok()
                        .content_type("text/html")
                        .body(vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 16, b'J', b'F', b'I', b'F'])
                } else {
                    HttpResponse::Ok()
                        .content_type("image/png")
                        .body(vec![0u8; 2 * 1024 * 1024])
                }
            }),
        )
    })
    .workers(1)
    .listen(listener)
    .unwrap()
    .run();
    tokio::spawn(server);
    format!("http://127.0.0.1:{port}")
}

#[tokio::test]
async fn a_download_is_capped_while_reading_and_typed_by_its_own_bytes() {
    use zhihui::dispatch::comfy::{ComfyClient, OutputImage};
    let url = hostile_view_server().await;
    let client = ComfyClient::new(&url, Duration::from_secs(20)).unwrap();
    let file = |name: &str| OutputImage {
        filename: name.into(),
        subfolder: "zhihui".into(),
        kind: "output".into(),
    };
    let limit = 1024 * 1024;
    // Endless: refused once past the cap, long before the client's timeout.
    let started = std::time::Instant::now();
    let endless = client.view(&file("endless"), limit).await.unwrap_err();
    assert!(format!("{endless:#}").contains("over"), "{endless:#}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Declared over the cap: refused before reading.
    let declared = client.view(&file("big"), limit).await.unwrap_err();
    assert!(format!("{declared:#}").contains("over"), "{declared:#}");
    // The server's content type is not believed.
    let html = client.view(&file("html"), limit).await.unwrap_err();
    assert!(
        format!("{html:#}").contains("not a PNG, JPEG or WebP"),
        "{html:#}"
    );
    let (bytes, content_type) = client.view(&file("jpeg"), limit).await.unwrap();
    assert_eq!((bytes.len(), content_type), (10, "image/jpeg"));
}

/// A browser opens its socket with a one-time ticket instead of putting its bearer token in the
/// URL: the ticket opens one socket, once; a used, expired (30 s, on the app's clock) or
/// logged-out ticket is refused with 401 `invalid-ticket` before any upgrade.
#[tokio::test]
async fn a_socket_ticket_opens_one_socket_once_and_never_when_used_expired_or_logged_out() {
    let app = spawn_app_with(|_| {}).await;
    app.register("ticketed", "a long password").await;
    let token = app.login("ticketed", "a long password").await;
    let ticket = |token: String| {
        let app = &app;
        async move {
            let response = app
                .post("/api/v1/ws/ticket", Some(&token), &json!({}))
                .await;
            assert_eq!(response.status(), 201);
            assert_eq!(response.headers()["cache-control"], "no-store");
            let body: Value = response.json().await.unwrap();
            body["ticket"].as_str().unwrap().to_owned()
        }
    };
    let socket_url = |query: &str| {
        format!(
            "{}/api/v1/ws?{query}",
            app.address.replace("http://", "ws://")
        )
    };
    let status_of = |query: String| {
        let url = socket_url(&query);
        async move {
            // Refused before the upgrade: the HTTP answer's status.
            let response = reqwest::Client::new()
                .get(url.replace("ws://", "http://"))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            (status, body["type"].as_str().unwrap_or_default().to_owned())
        }
    };

    // One ticket, one socket.
    let first = ticket(token.clone()).await;
    let (socket, _) =
        async_tungstenite::tokio::connect_async(socket_url(&format!("ticket={first}")))
            .await
            .expect("the ticket opens a socket");
    drop(socket);
    assert_eq!(
        status_of(format!("ticket={first}")).await,
        (401, "/problems/invalid-ticket".to_owned()),
        "a ticket opens one socket only"
    );
    // Expired after 30 s on the app's clock.
    let late = ticket(token.clone()).await;
    app.clock.advance(Duration::from_secs(30));
    assert_eq!(status_of(format!("ticket={late}")).await.0, 401);
    // Its session ended (logout): refused though unused and young.
    let orphan = ticket(token.clone()).await;
    let logout = app
        .post("/api/v1/auth/logout", Some(&token), &json!({}))
        .await;
    assert_eq!(logout.status(), 204);
    assert_eq!(status_of(format!("ticket={orphan}")).await.0, 401);
    // Garbage, and no ticket at all without a token, are refused too.
    assert_eq!(status_of("ticket=not-a-ticket".into()).await.0, 401);
    assert_eq!(status_of(String::new()).await.0, 401);
    // A ticket needs a session.
    let response = app.post("/api/v1/ws/ticket", None, &json!({})).await;
    assert_eq!(response.status(), 401);
}

/// With the code sender disabled (what production runs until an SMS sender exists: the log
/// sender is refused outside development), asking for a login code is a 503 naming the rule,
/// and no code is made.
#[tokio::test]
async fn with_the_code_sender_disabled_a_code_request_is_a_503_naming_it() {
    let app = spawn_app_with(|settings| {
        settings.auth.code_sender = zhihui::platform::configuration::CodeSenderKind::Disabled;
    })
    .await;
    let response = app
        .post(
            "/api/v1/auth/code",
            None,
            &json!({"phone": "+8613800138000"}),
        )
        .await;
    assert_eq!(response.status(), 503);
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/phone-login-disabled");
    assert_eq!(app.codes.count("+8613800138000"), 0);
}

/// Admission limits by client: logins per minute, code requests per hour, and a ceiling on codes
/// per minute overall, each a 429 naming its rule with `Retry-After`, refused before any
/// password is hashed or code sent. The client is the connection's address; `X-Forwarded-For` is
/// believed only when configured (else anyone names any address and escapes the limit).
#[tokio::test]
async fn logins_and_code_requests_are_limited_per_client_and_codes_overall() {
    let app = spawn_app_with(|settings| {
        settings.auth.logins_per_client_per_minute = 3;
        settings.auth.code_requests_per_client_per_hour = 2;
        settings.auth.code_requests_per_minute_max = 3;
        settings.http.client_ip_from_forwarded = true;
    })
    .await;
    let login = |client: &'static str| {
        let app = &app;
        async move {
            reqwest::Client::new()
                .post(format!("{}/api/v1/auth/login", app.address))
                .header("x-forwarded-for", client)
                .json(&json!({"username": "nobody-here", "password": "a wrong password"}))
                .send()
                .await
                .unwrap()
        }
    };
    for _ in 0..3 {
        assert_eq!(login("203.0.113.7").await.status(), 401);
    }
    let refused = login("203.0.113.7").await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/too-many-logins");
    // Another client is not held back; the next minute the first may try again.
    assert_eq!(login("198.51.100.1").await.status(), 401);
    app.clock.advance(Duration::from_secs(60));
    assert_eq!(login("203.0.113.7").await.status(), 401);

    let code = |client: &'static str, phone: &'static str| {
        let app = &app;
        async move {
            reqwest::Client::new()
                .post(format!("{}/api/v1/auth/code", app.address))
                .header("x-forwarded-for", client)
                .json(&json!({"phone": phone}))
                .send()
                .await
                .unwrap()
        }
    };
    // One client, many phones: two codes an hour, then refused, nothing sent.
    assert_eq!(code("203.0.113.7", "+8613800000001").await.status(), 202);
    assert_eq!(code("203.0.113.7", "+8613800000002").await.status(), 202);
    let refused = code("203.0.113.7", "+8613800000003").await;
    assert_eq!(refused.status(), 429);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/too-many-code-requests");
    assert_eq!(app.codes.count("+8613800000003"), 0);
    // Many clients: the overall ceiling (3 a minute) holds.
    assert_eq!(code("198.51.100.1", "+8613800000004").await.status(), 202);
    let refused = code("198.51.100.2", "+8613800000005").await;
    assert_eq!(refused.status(), 429);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/code-requests-busy");
    assert_eq!(app.codes.count("+8613800000005"), 0);
}

/// Without `http.client_ip_from_forwarded`, `X-Forwarded-For` names nobody: every address a
/// client makes up is the same client.
#[tokio::test]
async fn a_forwarded_address_is_not_believed_unless_configured() {
    let app = spawn_app_with(|settings| {
        settings.auth.logins_per_client_per_minute = 2;
    })
    .await;
    let mut statuses = Vec::new();
    for client in ["203.0.113.1", "203.0.113.2", "203.0.113.3"] {
        let response = reqwest::Client::new()
            .post(format!("{}/api/v1/auth/login", app.address))
            .header("x-forwarded-for", client)
            .json(&json!({"username": "nobody-here", "password": "a wrong password"}))
            .send()
            .await
            .unwrap();
        statuses.push(response.status().as_u16());
    }
    assert_eq!(statuses, [401, 401, 429]);
}

/// A path of ours under a method it does not take is a 405 naming the ones it takes (`Allow`);
/// an unknown path a 404; both problem+json (the contract fuzzer's "wrong response to an
/// undeclared method").
#[tokio::test]
async fn a_known_path_under_another_method_is_a_405_and_an_unknown_one_a_404() {
    let app = spawn_app_with(|_| {}).await;
    let client = reqwest::Client::new();
    let response = client
        .delete(format!("{}/api/v1/account", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(response.headers()["allow"], "GET");
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let response = client
        .put(format!(
            "{}/api/v1/tasks/0194b2a0-0000-7000-8000-000000000000",
            app.address
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(response.headers()["allow"], "GET");
    let response = client
        .get(format!("{}/api/v1/no/such/route", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["status"], 404);
}

/// The document says what the server does: every error answer is problem+json; an operation
/// that needs a token lists 401, an admin one 403, one that reads input 422; each operation
/// has an id of its own.
#[tokio::test]
async fn the_openapi_document_lists_problem_answers_where_they_apply() {
    let app = spawn_app_with(|_| {}).await;
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let mut checked = 0;
    // Operation ids name one operation each: clients generate functions from them, and a
    // contract fuzzer following links by id would otherwise call the wrong operation.
    let mut operation_ids = std::collections::HashMap::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let id = operation["operationId"].as_str().unwrap().to_owned();
            if let Some(earlier) = operation_ids.insert(id.clone(), format!("{method} {path}")) {
                panic!("operationId {id} names both {earlier} and {method} {path}");
            }
            let responses = operation["responses"].as_object().unwrap();
            for (status, response) in responses {
                if status.starts_with('4') || status.starts_with('5') {
                    assert!(
                        response["content"]["application/problem+json"].is_object(),
                        "{method} {path} {status}"
                    );
                }
            }
            if operation["security"].is_array() {
                assert!(responses.contains_key("401"), "{method} {path}: no 401");
            }
            if path.starts_with("/api/v1/admin/") {
                assert!(responses.contains_key("403"), "{method} {path}: no 403");
            }
            if operation.get("requestBody").is_some() {
                assert!(responses.contains_key("422"), "{method} {path}: no 422");
                assert!(responses.contains_key("413"), "{method} {path}: no 413");
            }
            checked += 1;
        }
    }
    assert!(checked > 30, "{checked} operations");
}

/// The values of an `enum` the document lists, without the `null` of an optional field.
fn listed(schema: &Value) -> Vec<Value> {
    schema["enum"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|value| !value.is_null())
        .cloned()
        .collect()
}

#[tokio::test]
async fn the_openapi_document_states_the_catalog_this_server_runs_and_a_request_built_from_it_is_accepted()
 {
    let app = spawn_app_with(|settings| {
        settings.tasks.steps_max = 30;
        settings.tasks.images_per_task_max = 2;
    })
    .await;
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let submit = &document["components"]["schemas"]["SubmitTaskRequest"]["properties"];
    assert_eq!(submit["steps"]["maximum"], 30);
    assert_eq!(submit["images"]["maximum"], 2);
    assert_eq!(
        listed(&submit["model"]),
        app.settings
            .tasks
            .models
            .iter()
            .map(|model| json!(model))
            .collect::<Vec<_>>()
    );
    let cfgs = listed(&submit["cfg"]);
    let number = |value: &Value| value.as_str().unwrap().parse::<f64>().unwrap();
    let bound = |value: rust_decimal::Decimal| value.to_string().parse::<f64>().unwrap();
    assert_eq!(number(&cfgs[0]), bound(app.settings.tasks.cfg_min));
    assert_eq!(
        number(cfgs.last().unwrap()),
        bound(app.settings.tasks.cfg_max)
    );

    let user = app.register("catalogued", "a long password").await;
    let token = app.login("catalogued", "a long password").await;
    let admin = app.admin_token("boss").await;
    let granted = app
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(&admin),
            &json!({"amount": "100", "reason": "fuzz"}),
        )
        .await;
    assert_eq!(granted.status(), 201);
    // The last value of every list and the top of every range, whole numbers written as a
    // floating-point client writes them (JSON Schema's `integer` counts 2.0 as 2).
    let last = |field: &str| listed(&submit[field]).last().cloned().unwrap();
    let request = json!({
        "prompt": "a lighthouse",
        "model": last("model"),
        "resolution": last("resolution"),
        "sampler": last("sampler"),
        "scheduler": last("scheduler"),
        "cfg": cfgs.last().unwrap(),
        "steps": 30.0,
        "images": 2.0,
        "seed": submit["seed"]["maximum"],
    });
    let accepted = app.post("/api/v1/tasks", Some(&token), &request).await;
    assert_eq!(accepted.status(), 201, "{}", accepted.text().await.unwrap());

    let mut half = request.clone();
    half["steps"] = json!(20.5);
    let refused = app.post("/api/v1/tasks", Some(&token), &half).await;
    assert_eq!(refused.status(), 422);
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("steps"),
        "{problem}"
    );
    let mut beyond = request.clone();
    beyond["steps"] = json!(31);
    assert_eq!(
        app.post("/api/v1/tasks", Some(&token), &beyond)
            .await
            .status(),
        422
    );
}

#[tokio::test]
async fn the_openapi_document_says_login_takes_a_password_or_a_phone_code_and_the_amount_shape() {
    let app = spawn_app_with(|_| {}).await;
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let schemas = &document["components"]["schemas"];
    let login = schemas["LoginRequest"]["oneOf"].as_array().unwrap();
    assert_eq!(login.len(), 2);
    assert_eq!(login[0]["required"], json!(["username", "password"]));
    assert_eq!(login[1]["required"], json!(["phone", "code"]));
    let amount = regex::Regex::new(
        schemas["GrantRequest"]["properties"]["amount"]["pattern"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    for accepted in ["1", "0.01", "0.5", "999999999.99", "1000000000", "12.30"] {
        assert!(amount.is_match(accepted), "{accepted}");
    }
    for refused in [
        "0",
        "0.00",
        "-1",
        "1.234",
        "1000000000.01",
        "1e3",
        "abc",
        "",
    ] {
        assert!(!amount.is_match(refused), "{refused}");
    }
}

#[tokio::test]
async fn a_control_character_in_free_text_is_a_422_naming_its_field_and_nothing_is_written() {
    let app = spawn_app_with(|_| {}).await;
    let admin = app.admin_token("guanliyuan").await;
    let user = app.register("xiaoming", "a long password").await;
    let token = app.login("xiaoming", "a long password").await;
    let now = app.clock.now();
    let batch = app
        .post(
            "/api/v1/admin/code-batches",
            Some(&admin),
            &json!({"count": 1, "points": "5", "valid_from": now, "valid_until": now + chrono::Duration::days(1), "note": "春节活动"}),
        )
        .await;
    assert_eq!(batch.status(), 202);
    let batch: Value = batch.json().await.unwrap();
    let batch = batch["batch_id"].as_str().unwrap().to_owned();
    // NUL cannot even be stored; the others are invisible or move the text around.
    for bad in [
        "补偿\u{0}积分",
        "补偿\u{7}积分",
        "补偿\n积分",
        "补偿\u{202E}积分",
    ] {
        let cases = [
            (
                format!("/api/v1/admin/accounts/{user}/grants"),
                &admin,
                json!({"amount": "5", "reason": bad}),
                "reason",
            ),
            (
                "/api/v1/admin/code-batches".to_owned(),
                &admin,
                json!({"count": 1, "points": "5", "valid_from": now, "valid_until": now + chrono::Duration::days(1), "note": bad}),
                "note",
            ),
            (
                format!("/api/v1/admin/code-batches/{batch}/revoke"),
                &admin,
                json!({"reason": bad}),
                "reason",
            ),
            (
                "/api/v1/admin/promotions".to_owned(),
                &admin,
                json!({"title": bad, "points": "10", "price": "0", "stock": 3,
                       "starts_at": now, "ends_at": now + chrono::Duration::hours(1)}),
                "title",
            ),
            (
                "/api/v1/me/keys".to_owned(),
                &token,
                json!({"name": bad, "scopes": ["tasks:read"]}),
                "name",
            ),
        ];
        for (path, token, body, field) in cases {
            let response = app.post(&path, Some(token), &body).await;
            assert_eq!(response.status(), 422, "{path} with {bad:?}");
            let problem: Value = response.json().await.unwrap();
            assert_eq!(
                (problem["field"].as_str(), problem["rule"].as_str()),
                (Some(field), Some("one_line")),
                "{path} with {bad:?}: {problem}"
            );
        }
    }
    // Nothing of it was written: no grant, no second batch, no promotion, no key, the batch live.
    let balance = app.get_json(&token, "/api/v1/account").await;
    assert_eq!(balance["available"], "0.00", "{balance}");
    let keys = app.get_json(&token, "/api/v1/me/keys").await;
    assert_eq!(keys.as_array().map(Vec::len), Some(0), "{keys}");
    let shown = app
        .get_json(&admin, &format!("/api/v1/admin/code-batches/{batch}"))
        .await;
    assert_ne!(shown["status"], "revoked", "{shown}");
    let promotions = app.get_json(&token, "/api/v1/promotions").await;
    assert!(
        !promotions.to_string().contains("补偿"),
        "no promotion made: {promotions}"
    );
}

#[tokio::test]
async fn an_event_the_store_cannot_hold_fails_its_own_command_and_not_those_batched_with_it() {
    use zhihui_domain::account::{AccountCommand, account_stream};
    use zhihui_domain::points::Amount;
    use zhihui_domain::user::UserId;

    let app = spawn_app_with(|_| {}).await;
    let user = app.register("xiaohong", "a long password").await;
    let stream = account_stream(UserId::from_uuid(uuid::Uuid::parse_str(&user).unwrap()));
    let services = app.services();
    let grant = |reason: &str| AccountCommand::Grant {
        operation_id: uuid::Uuid::now_v7(),
        amount: Amount::whole(1),
        reason: reason.to_owned(),
        at: app.clock.now(),
    };
    let metadata = || zhihui::platform::event_store::EventMetadata {
        correlation_id: uuid::Uuid::now_v7(),
        causation_id: None,
        actor: "admin:test".into(),
    };
    // Sent together, the good grants and the bad one meet in one actor's batch.
    let mut commands: Vec<(bool, AccountCommand)> = (0..8)
        .map(|n| (true, grant(&format!("第{n}次补偿"))))
        .collect();
    commands.insert(3, (false, grant("补偿\u{0}积分")));
    // A text that merely reads `\u0000` is text like any other.
    commands.push((true, grant(r"路径 C:\u0000\file")));
    let answers = futures::future::join_all(commands.into_iter().map(|(good, command)| {
        let services = &services;
        let stream = &stream;
        async move {
            (
                good,
                services.accounts.execute(stream, command, metadata()).await,
            )
        }
    }))
    .await;
    for (good, answer) in &answers {
        assert_eq!(answer.is_ok(), *good, "{answer:?}");
    }
    let token = app.login("xiaohong", "a long password").await;
    let balance = app.get_json(&token, "/api/v1/account").await;
    assert_eq!(balance["available"], "9.00", "{balance}");
}

#[tokio::test]
async fn an_amount_not_in_plain_digits_or_a_window_already_over_is_a_422_naming_the_field() {
    let app = spawn_app_with(|_| {}).await;
    let admin = app.admin_token("guanliyuan").await;
    let user = app.register("xiaoli", "a long password").await;
    let grants = format!("/api/v1/admin/accounts/{user}/grants");
    for amount in ["1e3", "+5", ".5", "00005", " 5", "5.", "五"] {
        let response = app
            .post(
                &grants,
                Some(&admin),
                &json!({"amount": amount, "reason": "补偿"}),
            )
            .await;
        assert_eq!(response.status(), 422, "{amount:?}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], "amount", "{amount:?}: {problem}");
    }
    // Plain digits, as text or as a number, are an amount.
    for (amount, total) in [
        (json!("0.5"), "0.50"),
        (json!(12), "12.50"),
        (json!("1000"), "1012.50"),
    ] {
        let response = app
            .post(
                &grants,
                Some(&admin),
                &json!({"amount": amount, "reason": "补偿"}),
            )
            .await;
        assert_eq!(response.status(), 201, "{amount}");
        let granted: Value = response.json().await.unwrap();
        assert_eq!(granted["available"], total, "{granted}");
    }
    let now = app.clock.now();
    let hours = chrono::Duration::hours;
    let batch = app
        .post(
            "/api/v1/admin/code-batches",
            Some(&admin),
            &json!({"count": 1, "points": "5", "valid_from": now - hours(2), "valid_until": now - hours(1), "note": "过期批次"}),
        )
        .await;
    assert_eq!(batch.status(), 422);
    let problem: Value = batch.json().await.unwrap();
    assert_eq!(
        (problem["field"].as_str(), problem["rule"].as_str()),
        (Some("valid_until"), Some("in_future")),
        "{problem}"
    );
    let promotion = app
        .post(
            "/api/v1/admin/promotions",
            Some(&admin),
            &json!({"title": "昨天的抢购", "points": "10", "price": "0", "stock": 3,
                   "starts_at": now - hours(2), "ends_at": now - hours(1)}),
        )
        .await;
    assert_eq!(promotion.status(), 422);
    let problem: Value = promotion.json().await.unwrap();
    assert_eq!(
        (problem["field"].as_str(), problem["rule"].as_str()),
        (Some("ends_at"), Some("in_future")),
        "{problem}"
    );
}

#[tokio::test]
async fn who_may_call_is_answered_before_what_they_sent() {
    let app = spawn_app_with(|_| {}).await;
    let user = app.register("xiaozhang", "a long password").await;
    let token = app.login("xiaozhang", "a long password").await;
    let bad = json!({"amount": "很多", "reason": 5});
    let grant = format!("/api/v1/admin/accounts/{user}/grants");
    assert_eq!(app.post(&grant, Some(&token), &bad).await.status(), 403);
    assert_eq!(app.post(&grant, None, &bad).await.status(), 401);
    assert_eq!(
        app.post("/api/v1/tasks", None, &json!({"prompt": 5}))
            .await
            .status(),
        401
    );
    // Signing up needs no caller: its body's problems are the answer.
    assert_eq!(
        app.post("/api/v1/auth/register", None, &json!({"username": 5}))
            .await
            .status(),
        422
    );
    // A caller who may: the body's problem, naming the field.
    let admin = app.admin_token("guanliyuan").await;
    let response = app.post(&grant, Some(&admin), &bad).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["field"], "amount", "{problem}");
}

#[tokio::test]
async fn a_batched_account_command_meeting_a_store_away_is_unavailable_not_a_bug() {
    use secrecy::ExposeSecret;
    use zhihui::platform::command::CommandError;
    use zhihui_domain::account::{AccountCommand, account_stream};

    let app = spawn_app_with(|_| {}).await;
    // The same settings, with PostgreSQL where nothing listens.
    let mut settings = app.settings.clone();
    let url = settings.database.url.expose_secret().to_owned();
    let (before, after) = url.rsplit_once('@').unwrap();
    let database = after.split_once('/').unwrap().1;
    settings.database.url = format!(
        "{before}@127.0.0.1:{}/{database}",
        crate::helpers::dead_port()
    )
    .into();
    let state = app.services_with(&settings);
    let stream = account_stream(zhihui_domain::user::UserId::from_uuid(uuid::Uuid::now_v7()));
    let answers = futures::future::join_all((0..3).map(|_| {
        state.accounts.execute(
            &stream,
            AccountCommand::Grant {
                operation_id: uuid::Uuid::now_v7(),
                amount: zhihui_domain::points::Amount::whole(1),
                reason: "补偿".into(),
                at: app.clock.now(),
            },
            crate::tasks::metadata(),
        )
    }))
    .await;
    for answer in answers {
        let Err(CommandError::Store(error)) = answer else {
            panic!("a store away is a store error: {answer:?}");
        };
        assert!(
            matches!(
                zhihui::http::ApiError::from(error),
                zhihui::http::ApiError::Unavailable { .. }
            ),
            "a 503, not a 500"
        );
    }
}

async fn next_notification(
    receiver: &mut tokio::sync::broadcast::Receiver<zhihui::platform::notify::Envelope>,
) -> zhihui::platform::notify::Envelope {
    tokio::time::timeout(Duration::from_secs(10), receiver.recv())
        .await
        .expect("a notification within 10 s")
        .unwrap()
}

/// The notification subscription a process keeps ends (here Redis drops it): the process opens
/// it again and tells its listeners so (`Envelope::Resubscribed`), since whatever was published
/// in between is lost: the gallery then drops every cached copy instead of keeping one a missed
/// hide should have removed. Notifications flow again after it.
#[tokio::test]
async fn a_notification_subscription_that_ended_is_opened_again_and_its_listeners_told() {
    use zhihui::platform::notify::{Envelope, NotificationHub, Notifier};

    let port = crate::helpers::free_port();
    let directory =
        std::env::temp_dir().join(format!("zhihui-resubscribe-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&directory).unwrap();
    let _redis = OwnRedis::start(port, &directory);
    let mut settings = crate::helpers::test_settings("unused");
    crate::helpers::one_redis_at(&mut settings, format!("redis://127.0.0.1:{port}/0"));
    let store = zhihui::platform::redis_store::RedisStore::new(&settings.redis).unwrap();
    let hub = NotificationHub::new(store.clone());
    let mut receiver = hub.subscribe().await.unwrap();
    let mut connection = store.connection().await.unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    assert!(matches!(
        next_notification(&mut receiver).await,
        Envelope::Resubscribed
    ));
    Notifier::new(store)
        .publish(&Envelope::GalleryChanged { work_id: None })
        .await
        .unwrap();
    assert!(matches!(
        next_notification(&mut receiver).await,
        Envelope::GalleryChanged { work_id: None }
    ));
    let _ = std::fs::remove_dir_all(&directory);
}

/// A Redis out of memory (`maxmemory` reached, nothing to evict) or unable to persist (a full
/// disk under its append-only file: MISCONF) refuses writes until an operator acts: the store is
/// away for now, so a request that needs a write is a 503 with `Retry-After`, not a 500; and
/// once it has room, the same request works.
#[tokio::test]
async fn a_redis_refusing_writes_for_memory_is_a_503_to_retry_not_a_bug() {
    let (_redis, port, directory, app) = app_on_own_redis(|_| {}).await;
    app.register("xiaoming", "a long password").await;
    let token = app.login("xiaoming", "a long password").await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let set_maxmemory = |bytes: &'static str| {
        let mut command = redis::cmd("CONFIG");
        command.arg("SET").arg("maxmemory").arg(bytes);
        command
    };
    let _: () = set_maxmemory("1").query_async(&mut admin).await.unwrap();

    // A login writes a session: refused by Redis, answered 503 to retry.
    let login = app
        .post(
            "/api/v1/auth/login",
            None,
            &serde_json::json!({"username": "xiaoming", "password": "a long password"}),
        )
        .await;
    assert_eq!(login.status(), 503, "{:?}", login.text().await);
    assert_eq!(login.headers()["retry-after"], "2");
    // So does any request with a session: using one slides its expiry, a write.
    let me = app.get_as(&token, "/api/v1/me").await;
    assert_eq!(me.status(), 503);
    assert_eq!(me.headers()["retry-after"], "2");

    let _: () = set_maxmemory("0").query_async(&mut admin).await.unwrap();
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 200);
    let again = app
        .post(
            "/api/v1/auth/login",
            None,
            &serde_json::json!({"username": "xiaoming", "password": "a long password"}),
        )
        .await;
    assert_eq!(again.status(), 200);
    let _ = std::fs::remove_dir_all(&directory);
}

/// A session that ended while the process's notification subscription was down (its "ended"
/// announcement lost with it) closes its socket as soon as the subscription is back, not at the
/// next ping: the socket checks its session on `Resubscribed`.
#[tokio::test]
async fn a_socket_whose_session_ended_unheard_closes_when_notifications_come_back() {
    use futures::StreamExt;

    let (_redis, port, directory, app) = app_on_own_redis(|settings| {
        // Far beyond the test's wait: only the resubscription can close the socket in time.
        settings.http.socket_ping_interval_ms = 120_000;
    })
    .await;
    app.register("lianjie", "a long password").await;
    let token = app.login("lianjie", "a long password").await;
    let mut socket = app.socket(&token).await;
    // The socket's first ping (sent at once, after a session check): the next is two minutes on.
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(message) = socket.next().await {
            if let Ok(async_tungstenite::tungstenite::Message::Ping(_)) = message {
                return;
            }
        }
        panic!("the socket ended before its first ping");
    })
    .await
    .expect("the first ping within 10 s");

    // The session goes with no announcement (as if published while nobody listened), then the
    // subscription drops and is opened again.
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = redis::cmd("FLUSHDB").query_async(&mut admin).await.unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("pubsub")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(killed >= 1);
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(message) = socket.next().await {
            match message {
                Ok(async_tungstenite::tungstenite::Message::Close(frame)) => return frame,
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
        None
    })
    .await
    .expect("the socket closed within 10 s, long before its next ping");
    let reason = closed
        .map(|frame| frame.reason.to_string())
        .unwrap_or_default();
    assert_eq!(reason, "session ended");
    let _ = std::fs::remove_dir_all(&directory);
}

/// The document's text patterns say what the server's rules say: a prompt (or a key's name) of
/// characters that draw nothing is blank, a direction control is refused, and a joined emoji or
/// Chinese text is fine; each sample is sent too, so the document and the server are compared.
#[tokio::test]
async fn the_openapi_text_patterns_agree_with_the_servers_rules() {
    let app = spawn_app_with(|_| {}).await;
    let token = app.admin_token("guanliyuan").await;
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let schemas = &document["components"]["schemas"];
    let pattern = |schema: &str, property: &str| {
        regex::Regex::new(
            schemas[schema]["properties"][property]["pattern"]
                .as_str()
                .unwrap(),
        )
        .unwrap()
    };
    let prompt = pattern("SubmitTaskRequest", "prompt");
    let key_name = pattern("CreateKeyRequest", "name");
    for (text, accepted) in [
        ("雪中的红狐狸", true),
        ("👩\u{200D}🎨 画家", true),
        ("\u{200B}", false),
        (" \u{FEFF}\u{2060} ", false),
        ("雪中\u{202E}狐狸", false),
    ] {
        assert_eq!(prompt.is_match(text), accepted, "prompt {text:?}");
        assert_eq!(key_name.is_match(text), accepted, "key name {text:?}");
        let status = app
            .post("/api/v1/tasks", Some(&token), &json!({"prompt": text}))
            .await
            .status()
            .as_u16();
        // Accepted prompts may still be refused for points (an admin has none): not for the text.
        assert_eq!(status != 422, accepted, "prompt {text:?}: {status}");
        let status = app
            .post(
                "/api/v1/me/keys",
                Some(&token),
                &json!({"name": text, "scopes": ["tasks:read"]}),
            )
            .await
            .status()
            .as_u16();
        assert_eq!(status != 422, accepted, "key name {text:?}: {status}");
    }
}

/// The public gallery answers anyone: a visitor's unreadable query is told as such (422 naming
/// the parameter), not taken for a missing login.
#[tokio::test]
async fn a_visitors_unreadable_query_on_the_public_gallery_is_a_422_naming_it() {
    let app = spawn_app_with(|_| {}).await;
    let response = app.get("/api/v1/gallery/hot?limit=abc").await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert_eq!(problem["field"], "limit", "{problem}");
}
