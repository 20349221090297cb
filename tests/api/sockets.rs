//! User sockets die with their session: a logout closes that session's sockets, a password or
//! role change all of the user's, an expired session its sockets at the next ping; a peer that
//! stops answering pings is dropped; a user opens a bounded number of sockets. Each close is seen
//! by the client as a close frame naming why. Waits are on events (frames, end of stream),
//! bounded by `LIMIT`.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use async_tungstenite::tungstenite::Message;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::{TestApp, spawn_app_with};

const LIMIT: Duration = Duration::from_secs(20);

use crate::helpers::Socket;

async fn app_with_pings_every(ms: u64, sockets_max: usize) -> TestApp {
    spawn_app_with(move |settings| {
        settings.http.socket_ping_interval_ms = ms;
        settings.http.sockets_per_user_max = sockets_max;
    })
    .await
}

fn socket_url(app: &TestApp, token: &str) -> String {
    format!(
        "{}/api/v1/ws?token={token}",
        app.address.replace("http://", "ws://")
    )
}

/// Read until the server's close frame: its reason (pings are answered while reading).
async fn closed_because(socket: &mut Socket) -> String {
    tokio::time::timeout(LIMIT, async {
        while let Some(frame) = socket.next().await {
            match frame {
                Ok(Message::Close(reason)) => {
                    return reason.map(|r| r.reason.to_string()).unwrap_or_default();
                }
                Ok(_) => continue,
                Err(error) => return format!("error: {error}"),
            }
        }
        "ended without a close frame".to_owned()
    })
    .await
    .expect("the socket was never closed")
}

/// Whether the socket is still open: a ping of ours is answered.
async fn still_open(socket: &mut Socket) -> bool {
    if socket
        .send(Message::Ping(b"alive?".to_vec().into()))
        .await
        .is_err()
    {
        return false;
    }
    tokio::time::timeout(LIMIT, async {
        while let Some(frame) = socket.next().await {
            match frame {
                Ok(Message::Pong(bytes)) if bytes.as_ref() == b"alive?" => return true,
                Ok(Message::Close(_)) | Err(_) => return false,
                Ok(_) => continue,
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}

#[tokio::test]
async fn a_logout_closes_that_sessions_sockets_and_a_password_change_all_of_the_users() {
    let app = app_with_pings_every(60_000, 8).await;
    app.register("alice", "a long password").await;
    app.register("bob", "a long password").await;
    let first = app.login("alice", "a long password").await;
    let second = app.login("alice", "a long password").await;
    let bob = app.login("bob", "a long password").await;
    let mut first_socket = app.socket(&first).await;
    let mut second_socket = app.socket(&second).await;
    let mut third_socket = app.socket(&second).await;
    let mut bob_socket = app.socket(&bob).await;

    let logout = app
        .post("/api/v1/auth/logout", Some(&first), &json!({}))
        .await;
    assert_eq!(logout.status(), 204);
    assert_eq!(closed_because(&mut first_socket).await, "session ended");
    assert!(
        still_open(&mut second_socket).await,
        "another session's socket closed"
    );

    let changed = app
        .put(
            "/api/v1/me/password",
            Some(&second),
            &json!({"current_password": "a long password", "new_password": "another long one"}),
        )
        .await;
    assert_eq!(changed.status(), 204);
    assert_eq!(closed_because(&mut second_socket).await, "session ended");
    assert_eq!(closed_because(&mut third_socket).await, "session ended");
    assert!(
        still_open(&mut bob_socket).await,
        "another user's socket closed"
    );
}

#[tokio::test]
async fn a_role_change_closes_the_users_sockets() {
    let app = app_with_pings_every(60_000, 8).await;
    app.register("carol", "a long password").await;
    let token = app.login("carol", "a long password").await;
    let admin = app.admin_token("socket-admin").await;
    let me: Value = app.get_as(&token, "/api/v1/me").await.json().await.unwrap();
    let mut socket = app.socket(&token).await;
    let response = app
        .put(
            &format!("/api/v1/admin/users/{}/role", me["id"].as_str().unwrap()),
            Some(&admin),
            &json!({"role": "admin"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(closed_because(&mut socket).await, "session ended");
}

#[tokio::test]
async fn an_expired_session_closes_its_socket_at_the_next_ping() {
    let app = app_with_pings_every(50, 8).await;
    app.register("dave", "a long password").await;
    let token = app.login("dave", "a long password").await;
    let mut socket = app.socket(&token).await;
    // Pings do not keep the session alive; past its idle lifetime it has ended.
    assert!(still_open(&mut socket).await);
    app.clock
        .advance(Duration::from_millis(app.settings.auth.session_idle_ttl_ms));
    assert_eq!(closed_because(&mut socket).await, "session ended");
}

/// A peer that never answers: a raw connection that upgrades, then reads without ever writing
/// (a WebSocket library would answer the pings by itself).
#[tokio::test]
async fn a_peer_that_stops_answering_pings_is_dropped() {
    let app = app_with_pings_every(50, 8).await;
    app.register("erin", "a long password").await;
    let token = app.login("erin", "a long password").await;
    let address = app.address.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let request = format!(
        "GET /api/v1/ws?token={token} HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Version: 13\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let ended = tokio::time::timeout(LIMIT, async {
        let mut buffer = [0u8; 4096];
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => received.extend_from_slice(&buffer[..read]),
            }
            // Stop at the server's close frame (opcode 8) after the upgrade answer.
            if let Some(start) = find(&received, b"\r\n\r\n")
                && close_frame_reason(&received[start + 4..]).is_some()
            {
                return;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the silent peer was never dropped");
    let start = find(&received, b"\r\n\r\n").unwrap();
    assert!(received.starts_with(b"HTTP/1.1 101"));
    assert_eq!(
        close_frame_reason(&received[start + 4..]).as_deref(),
        Some("no answer to pings")
    );
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// The reason of the first close frame among the server's (unmasked, short) frames.
fn close_frame_reason(mut frames: &[u8]) -> Option<String> {
    while frames.len() >= 2 {
        let opcode = frames[0] & 0x0F;
        let length = usize::from(frames[1] & 0x7F);
        if length >= 126 || frames.len() < 2 + length {
            return None;
        }
        let payload = &frames[2..2 + length];
        if opcode == 8 {
            return Some(String::from_utf8_lossy(payload.get(2..).unwrap_or_default()).into());
        }
        frames = &frames[2 + length..];
    }
    None
}

#[tokio::test]
async fn a_user_opens_at_most_the_configured_number_of_sockets() {
    let app = app_with_pings_every(60_000, 2).await;
    app.register("frank", "a long password").await;
    let token = app.login("frank", "a long password").await;
    let mut first = app.socket(&token).await;
    let _second = app.socket(&token).await;
    let refused = reqwest::Client::new()
        .get(format!("{}/api/v1/ws?token={token}", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/too-many-sockets");
    // Closing one gives its place back.
    first.close(None).await.unwrap();
    assert_eq!(closed_because(&mut first).await, "");
    let started = tokio::time::Instant::now();
    loop {
        match async_tungstenite::tokio::connect_async(socket_url(&app, &token)).await {
            Ok(_) => break,
            Err(_) => {
                assert!(started.elapsed() < LIMIT, "the place never came back");
                tokio::task::yield_now().await;
            }
        }
    }
}

/// Read text frames until every one of `expected` (task, position) pairs was heard; frames about
/// anything else are collected too and returned.
async fn hear_positions(socket: &mut Socket, expected: &[(String, u64)]) -> Vec<Value> {
    let mut heard = Vec::new();
    hear_until(socket, &mut heard, |heard| {
        expected.iter().all(|(task, position)| {
            heard
                .iter()
                .any(|m| m["task_id"] == task.as_str() && m["position"] == *position)
        })
    })
    .await;
    heard
}

/// Read messages into `heard` until `enough` says so (or fail after [`LIMIT`]).
async fn hear_until(
    socket: &mut Socket,
    heard: &mut Vec<Value>,
    enough: impl Fn(&[Value]) -> bool,
) {
    tokio::time::timeout(LIMIT, async {
        while !enough(heard) {
            match socket.next().await {
                Some(Ok(Message::Text(text))) => {
                    heard.push(serde_json::from_str(text.as_str()).unwrap());
                }
                Some(Ok(_)) => continue,
                other => panic!("the socket ended: {other:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("never heard what was awaited; heard {heard:?}"));
}

/// The places of a user's queued tasks follow the queue: when it opens, when a task ahead leaves,
/// and for a task it submits later (through any instance: told first as submitted); another
/// user's tasks are never told.
#[tokio::test]
async fn queue_places_reach_the_socket_when_it_opens_and_when_the_queue_moves() {
    let app = app_with_pings_every(60_000, 8).await;
    let (_, bob) = crate::tasks::funded_user(&app, "bob", "10").await;
    let (_, alice) = crate::tasks::funded_user(&app, "alice", "10").await;
    let submit = |token: String| {
        let app = &app;
        async move {
            let response =
                crate::tasks::submit(app, &token, &json!({"prompt": "a fox"}), None).await;
            assert_eq!(response.status(), 201);
            let body: Value = response.json().await.unwrap();
            body["task_id"].as_str().unwrap().to_owned()
        }
    };
    let bobs = submit(bob.clone()).await;
    let first = submit(alice.clone()).await;
    let second = submit(alice.clone()).await;
    app.project().await;
    let mut socket = app.socket(&alice).await;
    hear_positions(&mut socket, &[(first.clone(), 2), (second.clone(), 3)]).await;
    // Bob's task leaves the queue: alice's move up.
    let cancelled = app
        .post(
            &format!("/api/v1/tasks/{bobs}/cancel"),
            Some(&bob),
            &json!({}),
        )
        .await;
    assert_eq!(cancelled.status(), 200);
    let heard = hear_positions(&mut socket, &[(first.clone(), 1), (second.clone(), 2)]).await;
    // A new task of hers, submitted through another instance, is told as submitted (once, and
    // before its place), and followed too; the tasks queued before the socket opened never are.
    let other = app.another_instance().await;
    let response = crate::tasks::submit(&other, &alice, &json!({"prompt": "一只狐狸"}), None).await;
    assert_eq!(response.status(), 201);
    let third: Value = response.json().await.unwrap();
    let third = third["task_id"].as_str().unwrap().to_owned();
    let later = hear_positions(&mut socket, &[(third.clone(), 3)]).await;
    let submitted: Vec<&Value> = heard
        .iter()
        .chain(&later)
        .filter(|message| message["type"] == "submitted")
        .collect();
    assert_eq!(submitted, [&json!({"type": "submitted", "task_id": third})]);
    let told_first = later
        .iter()
        .position(|message| message["task_id"] == third.as_str());
    assert_eq!(
        told_first,
        later
            .iter()
            .position(|message| message["type"] == "submitted")
    );
    for message in heard.iter().chain(&later) {
        assert_ne!(
            message["task_id"],
            bobs.as_str(),
            "heard another user's task"
        );
    }
}

/// A task that left the queue before the socket followed it (its news was told to no one, the
/// read model not yet caught up): the socket says it left, so no page keeps showing its old place
/// beside the place of the task that took it.
#[tokio::test]
async fn a_task_that_left_the_queue_before_the_socket_opened_is_said_to_have_left() {
    let app = app_with_pings_every(60_000, 8).await;
    let (_, alice) = crate::tasks::funded_user(&app, "xiaoli", "10").await;
    let mut tasks = Vec::new();
    for prompt in ["雪中的红狐狸", "雨后的竹林"] {
        let response = crate::tasks::submit(&app, &alice, &json!({"prompt": prompt}), None).await;
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.unwrap();
        tasks.push(body["task_id"].as_str().unwrap().to_owned());
    }
    app.project().await;
    let cancelled = app
        .post(
            &format!("/api/v1/tasks/{}/cancel", tasks[0]),
            Some(&alice),
            &json!({}),
        )
        .await;
    assert_eq!(cancelled.status(), 200);
    // Not projected: the read model still has the first task queued when the socket opens.
    let mut socket = app.socket(&alice).await;
    let mut heard = hear_positions(&mut socket, &[(tasks[1].clone(), 1)]).await;
    hear_until(&mut socket, &mut heard, |heard| {
        heard
            .iter()
            .any(|m| m["type"] == "left_queue" && m["task_id"] == tasks[0].as_str())
    })
    .await;
    assert!(
        !heard
            .iter()
            .any(|m| m["type"] == "position" && m["task_id"] == tasks[0].as_str()),
        "a place for a task out of the queue: {heard:?}"
    );
}
