//! Migrations: applied at start, idempotent, refusing to run over a changed applied file.

use zhihui::platform::postgres::{build_pool, migrate};

use crate::helpers::{connect, create_database, spawn_app, test_settings};

#[tokio::test]
async fn migrating_twice_applies_nothing_the_second_time() {
    let settings = test_settings(&create_database().await);
    let pool = build_pool(&settings.database).expect("pool");
    let first = migrate(&pool).await.expect("first migration run");
    assert!(!first.applied.is_empty());
    let second = migrate(&pool).await.expect("second migration run");
    assert_eq!(second.applied, Vec::<String>::new());
}

#[tokio::test]
async fn concurrent_migrations_apply_each_file_once() {
    let settings = test_settings(&create_database().await);
    let pool = build_pool(&settings.database).expect("pool");
    let runs = futures::future::join_all((0..4).map(|_| migrate(&pool))).await;
    let mut applied_in_total = 0;
    for run in runs {
        applied_in_total += run.expect("every concurrent run succeeds").applied.len();
    }
    let client = connect(&settings).await;
    let rows = client
        .query("SELECT version FROM refinery_schema_history", &[])
        .await
        .expect("history readable");
    assert_eq!(applied_in_total, rows.len());
}

#[tokio::test]
async fn a_changed_applied_migration_is_refused() {
    let settings = test_settings(&create_database().await);
    let pool = build_pool(&settings.database).expect("pool");
    migrate(&pool).await.expect("first migration run");
    // Simulate an edited file: the recorded checksum no longer matches the embedded one.
    let client = connect(&settings).await;
    client
        .execute(
            "UPDATE refinery_schema_history SET checksum = '1' WHERE version = 1",
            &[],
        )
        .await
        .expect("tamper with history");
    let error = migrate(&pool)
        .await
        .expect_err("a divergent history is refused");
    let message = format!("{error:#}");
    assert!(message.contains("is different than"), "{message}");
}

#[tokio::test]
async fn serve_applies_migrations_at_start() {
    let app = spawn_app().await;
    let client = connect(&app.settings).await;
    let applied: i64 = client
        .query_one("SELECT count(*) FROM refinery_schema_history", &[])
        .await
        .expect("history readable")
        .get(0);
    assert!(applied >= 1);
    client
        .query_one("SELECT count(*) FROM events", &[])
        .await
        .expect("the event store schema exists");
}
