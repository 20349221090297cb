//! An HTTP worker's own connections (`zhihui::platform::worker_local`): on a thread marked as a worker,
//! checkouts come from a twin of the shared pool or connection opened there; elsewhere from the
//! shared one. The first tests run "workers" as threads with a single-threaded runtime of their
//! own, as actix does; the last runs two instances with `http.worker_local_connections` on.

#![allow(clippy::unwrap_used)]

use secrecy::ExposeSecret;
use zhihui::platform::postgres::{build_pool, checkout};
use zhihui::platform::redis_store::RedisStore;

use crate::helpers::{create_database, test_settings};

/// Runs `work` on a new thread with a single-threaded runtime, marked as an HTTP worker's or not.
/// Awaited, not joined: the shared pool's connections are driven by this test's runtime.
async fn on_thread<T: Send + 'static>(
    worker: bool,
    work: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> T {
    let (done, result) = tokio::sync::oneshot::channel();
    let main = tokio::runtime::Handle::current();
    std::thread::spawn(move || {
        if worker {
            zhihui::platform::worker_local::mark_http_worker(main);
        }
        let value = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(work());
        let _ = done.send(value);
    });
    result.await.expect("the thread finished its work")
}

/// The one value `sql` answers on a connection checked out of `pool` on this thread.
async fn ask<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    pool: &deadpool_postgres::Pool,
    sql: &str,
) -> T {
    checkout(pool)
        .await
        .unwrap()
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

async fn backend_pid(pool: &deadpool_postgres::Pool) -> i32 {
    ask(pool, "SELECT pg_backend_pid()").await
}

#[tokio::test]
async fn a_worker_checks_out_from_its_own_twin_and_the_shared_pool_serves_the_rest() {
    let settings = test_settings(&create_database().await);
    let shared = build_pool(&settings.database).unwrap();

    // A worker thread: two checkouts, one connection of its own twin, none of the shared pool.
    let pool = shared.clone();
    let worker = on_thread(true, move || {
        Box::pin(async move {
            let first = backend_pid(&pool).await;
            let second = backend_pid(&pool).await;
            let opened_here = pool.status().size;
            (first, second, opened_here)
        })
    })
    .await;
    assert_eq!(
        worker.0, worker.1,
        "the worker reuses its twin's connection"
    );
    assert_eq!(worker.2, 0, "the worker opened nothing in the shared pool");

    // Off a worker thread (this test's runtime, another thread): the shared pool.
    let here = backend_pid(&shared).await;
    assert_eq!(shared.status().size, 1);
    assert_ne!(here, worker.0);
    let pool = shared.clone();
    let elsewhere = on_thread(false, move || {
        Box::pin(async move { backend_pid(&pool).await })
    })
    .await;
    assert_eq!(
        elsewhere, here,
        "an unmarked thread takes the shared pool's connection"
    );

    // Another worker: a twin of its own.
    let pool = shared.clone();
    let other = on_thread(true, move || {
        Box::pin(async move { backend_pid(&pool).await })
    })
    .await;
    assert_ne!(other, worker.0);
    assert_ne!(other, here);
}

#[tokio::test]
async fn a_worker_takes_the_twin_of_the_pool_it_is_given_never_one_of_a_dropped_pool() {
    let first = test_settings(&create_database().await).database;
    let second_name = create_database().await;
    let second = test_settings(&second_name).database;
    let (before, after) = on_thread(true, move || {
        Box::pin(async move {
            async fn current_database(pool: deadpool_postgres::Pool) -> String {
                ask(&pool, "SELECT current_database()").await
            }
            // The first pool (and its twin's original) is dropped before the second is built.
            let before = current_database(build_pool(&first).unwrap()).await;
            let after = current_database(build_pool(&second).unwrap()).await;
            (before, after)
        })
    })
    .await;
    assert_ne!(before, after);
    assert_eq!(after, second_name);
}

#[tokio::test]
async fn a_worker_has_its_own_redis_connection_and_others_share_one() {
    let settings = test_settings(&create_database().await);
    if !settings.redis.cluster_nodes.expose_secret().is_empty() {
        // CLIENT ID names the node a cluster routes it to, not one connection.
        return;
    }
    let store = RedisStore::new(&settings.redis).unwrap();
    async fn client_id(store: &RedisStore) -> i64 {
        let mut connection = store.connection().await.unwrap();
        redis::cmd("CLIENT")
            .arg("ID")
            .query_async(&mut connection)
            .await
            .unwrap()
    }
    let here = client_id(&store).await;
    assert_eq!(client_id(&store).await, here);
    let shared = store.clone();
    let elsewhere = on_thread(false, move || {
        Box::pin(async move { client_id(&shared).await })
    })
    .await;
    assert_eq!(
        elsewhere, here,
        "an unmarked thread shares the process's connection"
    );
    let mine = store.clone();
    let (first, second) = on_thread(true, move || {
        Box::pin(async move { (client_id(&mine).await, client_id(&mine).await) })
    })
    .await;
    assert_eq!(first, second, "a worker reuses its own connection");
    assert_ne!(first, here, "a worker's connection is not the shared one");
}

/// Two instances, one with `http.worker_local_connections` on (its task commands run on its main
/// runtime, its reads on its workers' own connections) and one with it off (every request on its
/// worker with the shared connections), one request through each in turn: a grant, a freeze, a
/// prioritise fee and a cancel move the balance once each (read through the other instance every
/// time, with a Chinese prompt), and the projected rows agree with the events.
#[tokio::test]
async fn money_moves_once_through_two_instances_on_worker_local_connections() {
    use serde_json::{Value, json};
    let a = crate::helpers::spawn_app_with(|settings| {
        settings.http.worker_local_connections = true;
    })
    .await;
    let b = a
        .another_instance_with(|settings| settings.http.worker_local_connections = false)
        .await;
    let user = a.register("local-conn", "correct horse battery").await;
    let token = b.login("local-conn", "correct horse battery").await;
    let admin = a.admin_token("admin-local").await;
    let balance = |app| crate::instances::balance_via(app, &token);

    let granted = a
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(&admin),
            &json!({"amount": "100", "reason": "本地连接测试"}),
        )
        .await;
    assert_eq!(granted.status(), 201);
    assert_eq!(balance(&b).await, ("100.00".into(), "0.00".into()));

    async fn submit_via(app: &crate::helpers::TestApp, token: &str, images: u32) -> String {
        let submitted = app
            .post(
                "/api/v1/tasks",
                Some(token),
                &json!({"prompt": "一只在雪地里奔跑的红狐狸", "images": images, "steps": 2}),
            )
            .await;
        assert_eq!(submitted.status(), 201);
        submitted.json::<Value>().await.unwrap()["task_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }
    let first = submit_via(&b, &token, 2).await;
    assert_eq!(balance(&a).await, ("98.00".into(), "2.00".into()));
    let second = submit_via(&a, &token, 1).await;
    assert_eq!(balance(&b).await, ("97.00".into(), "3.00".into()));

    // The second moves ahead of the first: a fee, charged once.
    let prioritised = crate::tasks::act(&b, &token, "prioritise", &second).await;
    assert_eq!(prioritised.status(), 200);
    let (available, frozen) = balance(&a).await;
    assert_eq!(frozen, "3.00");
    let after_fee = available.parse::<f64>().unwrap();
    assert!(
        after_fee < 97.0,
        "the prioritise fee was charged: {available}"
    );

    // Both cancelled while queued, each through the other instance: their holds come back.
    assert_eq!(
        crate::tasks::act(&a, &token, "cancel", &first)
            .await
            .status(),
        200
    );
    assert_eq!(
        crate::tasks::act(&b, &token, "cancel", &second)
            .await
            .status(),
        200
    );
    assert_eq!(
        balance(&a).await,
        (format!("{:.2}", after_fee + 3.0), "0.00".into())
    );

    a.project().await;
    let verified = a.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}
