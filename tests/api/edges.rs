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

/// A Redis server of this test's own, started with `scripts/redis.conf` in a fresh directory.
struct OwnRedis {
    child: std::process::Child,
    port: u16,
    directory: std::path::PathBuf,
}

impl OwnRedis {
    fn start(port: u16, directory: &std::path::Path) -> OwnRedis {
        let child = std::process::Command::new("redis-server")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/redis.conf"))
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(directory)
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

#[tokio::test]
async fn a_redis_restarted_with_the_repositorys_configuration_keeps_every_session() {
    let port = crate::helpers::dead_port();
    let directory = std::env::temp_dir().join(format!("zhihui-redis-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&directory).unwrap();
    let redis = OwnRedis::start(port, &directory);
    let app = spawn_app_with(|settings| {
        settings.redis.url = secrecy::SecretString::from(format!("redis://127.0.0.1:{port}/0"));
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
    })
    .await;
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
