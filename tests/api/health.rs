//! `/health` and `/ready`, including readiness with a dependency down.

use secrecy::SecretString;

use crate::helpers::{dead_port, spawn_app, spawn_app_with};

#[tokio::test]
async fn health_answers_200() {
    let app = spawn_app().await;
    let response = app.get("/health").await;
    assert_eq!(response.status().as_u16(), 200);
}

#[tokio::test]
async fn ready_answers_200_when_postgres_and_redis_answer() {
    let app = spawn_app().await;
    let response = app.get("/ready").await;
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn ready_answers_503_naming_redis_when_redis_is_unreachable() {
    let port = dead_port();
    let app = spawn_app_with(|settings| {
        crate::helpers::one_redis_at(settings, format!("redis://127.0.0.1:{port}/0"));
        settings.redis.connect_timeout_ms = 500;
    })
    .await;
    let response = app.get("/ready").await;
    assert_eq!(response.status().as_u16(), 503);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|value| value.to_str().ok()),
        Some("application/problem+json")
    );
    let body: serde_json::Value = response.json().await.expect("problem+json body");
    assert_eq!(body["dependencies"], serde_json::json!(["redis"]), "{body}");
    assert!(
        body["detail"].as_str().unwrap_or("").contains("redis"),
        "{body}"
    );
}

#[tokio::test]
async fn ready_answers_503_naming_postgres_when_postgres_is_unreachable() {
    let port = dead_port();
    // Start normally (migrations need the database), then point a second app at a dead port
    // with migrations off: it must still start and report PostgreSQL as the failed dependency.
    let app = spawn_app_with(|settings| {
        settings.database.url =
            SecretString::from(format!("postgres://zhihui@127.0.0.1:{port}/nothing"));
        settings.database.migrate_on_start = false;
        settings.database.connect_timeout_ms = 500;
    })
    .await;
    let response = app.get("/ready").await;
    assert_eq!(response.status().as_u16(), 503);
    let body: serde_json::Value = response.json().await.expect("problem+json body");
    assert_eq!(
        body["dependencies"],
        serde_json::json!(["postgres"]),
        "{body}"
    );
}
