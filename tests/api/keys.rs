//! API keys: made with a person's session and shown once; a bearer key works where a
//! session token does, within its scopes; revoked everywhere at once; a typo refused offline;
//! each key with its own rate; the audit names the key that moved the points.

#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};

use crate::auth::problem_of;
use crate::helpers::{TestApp, dead_port, spawn_app, spawn_app_with};
use crate::tasks::funded_user;

async fn make_key(app: &TestApp, token: &str, body: Value) -> reqwest::Response {
    app.post("/api/v1/me/keys", Some(token), &body).await
}

async fn key_with(app: &TestApp, token: &str, scopes: &[&str]) -> (String, String) {
    let response = make_key(app, token, json!({"name": "商城后台", "scopes": scopes})).await;
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    let body: Value = response.json().await.unwrap();
    (
        body["key"].as_str().unwrap().to_owned(),
        body["key_id"].as_str().unwrap().to_owned(),
    )
}

fn problem_type(body: &Value) -> &str {
    body["type"].as_str().unwrap_or("")
}

#[tokio::test]
async fn a_key_works_within_its_scopes_and_names_the_scope_it_lacks() {
    let app = spawn_app().await;
    let (user, token) = funded_user(&app, "shop", "10").await;
    let (reader, _) = key_with(&app, &token, &["tasks:read", "account:read"]).await;
    assert!(reader.starts_with("zhk_") && reader.len() == 64);

    // Without tasks:write: refused, naming the scope, nothing frozen.
    let refused = app
        .post("/api/v1/tasks", Some(&reader), &json!({"prompt": "一只猫"}))
        .await;
    assert_eq!(refused.status(), 403);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(problem_type(&body), "/problems/scope-missing");
    assert!(
        body["detail"].as_str().unwrap().contains("tasks:write"),
        "{body}"
    );
    let balance: Value = app
        .get_as(&reader, "/api/v1/account")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(balance["available"], "10.00");

    // With it: a task, and the key recorded as the actor of the points it froze.
    let (writer, writer_id) = key_with(&app, &token, &["tasks:write", "tasks:read"]).await;
    let submitted = app
        .post(
            "/api/v1/tasks",
            Some(&writer),
            &json!({"prompt": "一只猫", "steps": 2}),
        )
        .await;
    assert_eq!(submitted.status(), 201);
    let task: Value = submitted.json().await.unwrap();
    let view = app
        .get_as(
            &writer,
            &format!("/api/v1/tasks/{}", task["task_id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(view.status(), 200);
    app.project().await;
    let audit = app.cli(&["audit", "account", &user, "--json"]);
    let movements: Value = serde_json::from_slice(&audit.stdout).unwrap();
    let freeze = movements
        .as_array()
        .unwrap()
        .iter()
        .find(|movement| movement["kind"] == "freeze")
        .unwrap();
    assert_eq!(
        freeze["actor"],
        format!("user:{user}/key:{writer_id}"),
        "the audit names the key"
    );

    // What takes a person's session is refused to any key, naming why.
    for (method, path) in [
        (reqwest::Method::POST, "/api/v1/me/keys"),
        (reqwest::Method::POST, "/api/v1/ws/ticket"),
        (reqwest::Method::POST, "/api/v1/auth/logout"),
        (reqwest::Method::GET, "/api/v1/admin/queue"),
    ] {
        let response = app
            .http
            .request(method.clone(), format!("{}{path}", app.address))
            .bearer_auth(&writer)
            .json(&json!({"name": "x", "scopes": ["tasks:read"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 403, "{method} {path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(problem_type(&body), "/problems/scope-missing", "{path}");
    }
    // The public gallery, which a visitor reads without logging in, answers a key of any scope
    // (a missing work or creator is still a 404, as for the visitor).
    for path in [
        "/api/v1/gallery/hot".to_owned(),
        "/api/v1/gallery/new".to_owned(),
        format!("/api/v1/gallery/creators/{user}"),
        format!("/api/v1/gallery/creators/{user}/works"),
    ] {
        let visitor = app.get(&path).await.status();
        let keyed = app.get_as(&reader, &path).await;
        assert_eq!(
            (visitor.as_u16(), keyed.status().as_u16()),
            (200, 200),
            "{path}"
        );
    }
    let missing = format!("/api/v1/gallery/works/{}", uuid::Uuid::now_v7());
    assert_eq!(app.get_as(&reader, &missing).await.status(), 404);
    // Keys are listed without the keys themselves.
    let listed: Value = app
        .get_as(&token, "/api/v1/me/keys")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2);
    assert!(!listed.to_string().contains("zhk_"), "{listed}");
    assert_eq!(listed[0]["name"], "商城后台");
    assert!(listed[0]["last_used_at"].is_string(), "{listed}");
}

#[tokio::test]
async fn key_rules_are_checked_naming_the_field() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "rules", "1").await;
    for (body, field) in [
        (json!({"name": "", "scopes": ["tasks:read"]}), "name"),
        (json!({"name": "x", "scopes": []}), "scopes"),
        (json!({"name": "x", "scopes": ["tasks:delete"]}), "scopes"),
        (json!({"name": "x", "scopes": ["admin"]}), "scopes"),
        (
            json!({"name": "x", "scopes": ["tasks:read"], "expires_at": "2020-01-01T00:00:00Z"}),
            "expires_at",
        ),
        (
            json!({"name": "x", "scopes": ["tasks:read"], "requests_per_minute": 0}),
            "requests_per_minute",
        ),
    ] {
        let response = make_key(&app, &token, body.clone()).await;
        assert_eq!(response.status(), 422, "{body}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], field, "{body}: {problem}");
    }
    // An admin's key may hold the admin scope; it loses it with the role.
    let admin = app.admin_token("keyadmin").await;
    let (admin_key, _) = key_with(&app, &admin, &["admin"]).await;
    assert_eq!(
        app.get_as(&admin_key, "/api/v1/admin/queue").await.status(),
        200
    );
    let me: Value = app.get_as(&admin, "/api/v1/me").await.json().await.unwrap();
    let other_admin = app.admin_token("keyadmin2").await;
    // Who is an admin is decided by people: the admin scope does not reach roles, and an admin
    // never changes their own (the last one could otherwise leave none).
    let role_path = format!("/api/v1/admin/users/{}/role", me["id"].as_str().unwrap());
    let (status, problem) = problem_of(
        app.put(&role_path, Some(&admin_key), &json!({"role": "user"}))
            .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (403, Some("/problems/scope-missing"))
    );
    let keys_path = format!("/api/v1/admin/users/{}/keys", me["id"].as_str().unwrap());
    let (status, problem) = problem_of(
        app.post(
            &keys_path,
            Some(&admin_key),
            &json!({"name": "一把新钥匙", "scopes": ["admin"]}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (403, Some("/problems/scope-missing")),
        "a key never makes keys"
    );
    let (status, problem) = problem_of(
        app.put(&role_path, Some(&admin), &json!({"role": "user"}))
            .await,
    )
    .await;
    assert_eq!(
        (status, problem["type"].as_str()),
        (409, Some("/problems/own-role"))
    );
    let still: Value = app.get_as(&admin, "/api/v1/me").await.json().await.unwrap();
    assert_eq!(still["role"], "admin");
    let demoted = app
        .put(
            &format!("/api/v1/admin/users/{}/role", me["id"].as_str().unwrap()),
            Some(&other_admin),
            &json!({"role": "user"}),
        )
        .await;
    assert_eq!(demoted.status(), 200);
    assert_eq!(
        app.get_as(&admin_key, "/api/v1/admin/queue").await.status(),
        403
    );
}

#[tokio::test]
async fn a_revoked_key_is_refused_on_both_instances_within_a_second() {
    let app = spawn_app().await;
    let other = app.another_instance().await;
    let (_, token) = funded_user(&app, "revoker", "1").await;
    let (key, key_id) = key_with(&app, &token, &["account:read"]).await;
    // Both instances have answered it (and Redis holds its answer).
    for instance in [&app, &other] {
        assert_eq!(instance.get_as(&key, "/api/v1/account").await.status(), 200);
    }
    let revoked = app
        .http
        .delete(format!("{}/api/v1/me/keys/{key_id}", app.address))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(revoked.status(), 204);
    let answered = std::time::Instant::now();
    for instance in [&other, &app] {
        let response = instance.get_as(&key, "/api/v1/account").await;
        assert_eq!(response.status(), 401);
        let body: Value = response.json().await.unwrap();
        assert_eq!(problem_type(&body), "/problems/invalid-key");
    }
    assert!(answered.elapsed() < std::time::Duration::from_secs(1));
    let listed: Value = app
        .get_as(&token, "/api/v1/me/keys")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(listed[0]["state"], "revoked");
}

#[tokio::test]
async fn a_mistyped_key_is_refused_without_asking_any_store() {
    // Neither PostgreSQL nor Redis answers this instance.
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "typist", "1").await;
    let (key, _) = key_with(&app, &token, &["account:read"]).await;
    let redis_port = dead_port();
    let pg_port = dead_port();
    let blind = spawn_app_with(move |settings| {
        crate::helpers::one_redis_at(settings, format!("redis://127.0.0.1:{redis_port}"));
        settings.database.url =
            secrecy::SecretString::from(format!("postgres://zhihui@127.0.0.1:{pg_port}/nothing"));
        settings.database.migrate_on_start = false;
        settings.redis.connect_timeout_ms = 200;
        settings.database.connect_timeout_ms = 200;
    })
    .await;
    let mut typo = key.clone().into_bytes();
    typo[20] = if typo[20] == b'A' { b'B' } else { b'A' };
    let typo = String::from_utf8(typo).unwrap();
    for text in [
        typo.as_str(),
        "zhk_short",
        "zhk_0000000000000000000000000000000000000000000000000000000000",
    ] {
        let started = std::time::Instant::now();
        let response = blind.get_as(text, "/api/v1/account").await;
        assert_eq!(response.status(), 401, "{text}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(problem_type(&body), "/problems/invalid-key");
        assert!(
            started.elapsed() < std::time::Duration::from_millis(150),
            "{text}"
        );
    }
    // A well-formed key has to be looked up: with no store that is a 503, not a refusal.
    assert_eq!(blind.get_as(&key, "/api/v1/account").await.status(), 503);
}

#[tokio::test]
async fn each_key_has_its_own_rate_and_says_when_to_come_back() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "busy", "1").await;
    let slow = make_key(
        &app,
        &token,
        json!({"name": "slow", "scopes": ["account:read"], "requests_per_minute": 3}),
    )
    .await;
    let slow: Value = slow.json().await.unwrap();
    let slow = slow["key"].as_str().unwrap().to_owned();
    let (fast, _) = key_with(&app, &token, &["account:read"]).await;
    for _ in 0..3 {
        assert_eq!(app.get_as(&slow, "/api/v1/account").await.status(), 200);
    }
    let limited = app.get_as(&slow, "/api/v1/account").await;
    assert_eq!(limited.status(), 429);
    let retry_after: u64 = limited.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let body: Value = limited.json().await.unwrap();
    assert_eq!(problem_type(&body), "/problems/key-rate-limited");
    // Another key of the same user is not slowed by it.
    assert_eq!(app.get_as(&fast, "/api/v1/account").await.status(), 200);
    // The window passes: the key works again.
    app.clock.advance(std::time::Duration::from_secs(61));
    assert_eq!(app.get_as(&slow, "/api/v1/account").await.status(), 200);
}

/// The limit holds in every minute, not per calendar minute: sixty requests in 0.66 s across a
/// minute's boundary pass thirty times, not sixty (a counter per calendar minute let both
/// halves through), and the key comes back when its first request is a minute old.
#[tokio::test]
async fn a_key_limited_to_thirty_a_minute_passes_thirty_across_a_minutes_boundary() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "boundary", "1").await;
    let key = make_key(
        &app,
        &token,
        json!({"name": "整点", "scopes": ["account:read"], "requests_per_minute": 30}),
    )
    .await;
    let key: Value = key.json().await.unwrap();
    let key = key["key"].as_str().unwrap().to_owned();
    let step = std::time::Duration::from_millis(11);
    // 330 ms before the next minute starts.
    let into_minute = app.clock.now().timestamp_millis().rem_euclid(60_000) as u64;
    app.clock
        .advance(std::time::Duration::from_millis(60_000 - into_minute - 330));
    let first = app.clock.now();
    let mut admitted = Vec::new();
    let mut last_refusal = None;
    for _ in 0..60 {
        let response = app.get_as(&key, "/api/v1/account").await;
        match response.status().as_u16() {
            200 => admitted.push(app.clock.now()),
            429 => last_refusal = Some(response),
            other => panic!("{other}"),
        }
        app.clock.advance(step);
    }
    assert_eq!(admitted.len(), 30, "{admitted:?}");
    assert!(
        admitted
            .iter()
            .all(|at| *at < first + chrono::Duration::milliseconds(330)),
        "the first thirty, all before the boundary: {admitted:?}"
    );
    let refusal = last_refusal.unwrap();
    let retry_after: i64 = refusal.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body: Value = refusal.json().await.unwrap();
    assert_eq!(problem_type(&body), "/problems/key-rate-limited");
    // Told to come back when the first request leaves the window (about 59.3 s from the last).
    assert!((59..=60).contains(&retry_after), "{retry_after}");
    let retry_at = chrono::DateTime::parse_from_rfc3339(body["retry_at"].as_str().unwrap())
        .unwrap()
        .with_timezone(&chrono::Utc);
    assert_eq!(
        retry_at.timestamp_millis(),
        first.timestamp_millis() + 60_000
    );

    // A millisecond before: still refused; at that moment: one more, and no second.
    let now = app.clock.now();
    app.clock.advance(
        (retry_at - now - chrono::Duration::milliseconds(1))
            .to_std()
            .unwrap(),
    );
    assert_eq!(app.get_as(&key, "/api/v1/account").await.status(), 429);
    app.clock.advance(std::time::Duration::from_millis(1));
    assert_eq!(app.get_as(&key, "/api/v1/account").await.status(), 200);
    assert_eq!(app.get_as(&key, "/api/v1/account").await.status(), 429);
}

/// The public gallery answers any key, but what its owner follows or blocked is shown only to a
/// key with `gallery:write`: to any other it is the visitor's answer, field for field.
#[tokio::test]
async fn a_key_without_the_gallery_scope_reads_the_gallery_as_a_visitor() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "guanzhe", "10").await;
    let creator = app.register("huajia", "correct horse battery").await;
    let followed = app
        .http
        .put(format!(
            "{}/api/v1/gallery/creators/{creator}/follow",
            app.address
        ))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(followed.status(), 200);
    let (reader, _) = key_with(&app, &token, &["tasks:read", "account:read"]).await;
    let (gallery, _) = key_with(&app, &token, &["gallery:write"]).await;
    let path = format!("/api/v1/gallery/creators/{creator}");
    let as_visitor: Value = app.get(&path).await.json().await.unwrap();
    let as_reader: Value = app.get_as(&reader, &path).await.json().await.unwrap();
    let as_gallery: Value = app.get_as(&gallery, &path).await.json().await.unwrap();
    assert_eq!(as_reader, as_visitor);
    assert!(as_visitor.get("followed").is_none(), "{as_visitor}");
    assert_eq!(as_gallery["followed"], true, "{as_gallery}");
    assert_eq!(as_gallery["followers"], 1);
}
