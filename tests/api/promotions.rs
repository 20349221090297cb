//! Flash-sale promotions: the Redis gate never oversells and never lets a user claim twice, across
//! processes, with Redis flushed mid-sale; the claims stream's consumers persist every accepted
//! claim exactly once, a dead consumer's claims are taken over, a claim that keeps failing is
//! parked; prices are charged or the claim refused with its unit back; `audit verify` agrees.

#![allow(clippy::unwrap_used)]

use std::collections::{HashMap, HashSet};

use futures::StreamExt;
use serde_json::{Value, json};
use uuid::Uuid;
use zhihui::points::promotions::ClaimEntry;
use zhihui_domain::user::{Role, UserId};

use crate::helpers::{TestApp, flush_redis, spawn_app_with};
use crate::tasks::project_and_verify;

async fn spawn_sale_app() -> TestApp {
    spawn_app_with(|settings| {
        settings.auth.argon2_memory_kib = 1024;
        settings.auth.argon2_iterations = 1;
        // Taken over at once: the test says when a consumer has died.
        settings.promotions.takeover_idle_ms = 0;
        settings.promotions.deliveries_max = 2;
    })
    .await
}

/// Sessions for `count` new users (no registration: a claim needs only a caller).
async fn users(app: &TestApp, count: usize) -> Vec<(UserId, String)> {
    let services = app.services_on_app_clock();
    let mut made = Vec::new();
    for _ in 0..count {
        let user_id = UserId::from_uuid(Uuid::now_v7());
        let since = services.sessions.login_epoch().await.unwrap();
        let (token, _) = services
            .sessions
            .create(user_id, Role::User, since)
            .await
            .unwrap()
            .unwrap();
        made.push((user_id, token));
    }
    made
}

async fn create_promotion(app: &TestApp, admin: &str, stock: u32, price: &str) -> Uuid {
    let now = app.clock.now();
    let response = app
        .post(
            "/api/v1/admin/promotions",
            Some(admin),
            &json!({
                "title": "Spring pack", "points": "10", "price": price, "stock": stock,
                "starts_at": now - chrono::Duration::hours(1),
                "ends_at": now + chrono::Duration::hours(1),
            }),
        )
        .await;
    assert_eq!(response.status(), 201, "{:?}", response.text().await);
    let body: Value = response.json().await.unwrap();
    Uuid::parse_str(body["promotion_id"].as_str().unwrap()).unwrap()
}

/// Fire one claim per (instance, token), 200 at a time; (status, body) per claim in order.
async fn claim_all(
    instances: &[&TestApp],
    promotion: Uuid,
    tokens: &[String],
) -> Vec<(u16, Value)> {
    futures::stream::iter(tokens.iter().enumerate())
        .map(|(index, token)| {
            let instance = instances[index % instances.len()];
            async move {
                let response = instance
                    .post(
                        &format!("/api/v1/promotions/{promotion}/claims"),
                        Some(token),
                        &json!({}),
                    )
                    .await;
                let status = response.status().as_u16();
                (status, response.json::<Value>().await.unwrap())
            }
        })
        .buffered(200)
        .collect()
        .await
}

/// Run the consumers of both instances until the stream has nothing new.
pub(crate) async fn consume_all(instances: &[&TestApp]) -> usize {
    let services: Vec<_> = instances.iter().map(|app| app.services()).collect();
    let mut persisted = 0;
    loop {
        let mut read = 0;
        for (index, service) in services.iter().enumerate() {
            let report = service
                .promotions
                .consume_once(&format!("consumer-{index}"), None)
                .await
                .unwrap();
            assert_eq!(report.failed, 0, "{report:?}");
            read += report.read;
            persisted += report.acknowledged;
        }
        if read == 0 {
            return persisted;
        }
    }
}

async fn left_at_gate(app: &TestApp, promotion: Uuid) -> Option<i64> {
    app.services()
        .promotions
        .left_in_redis(promotion)
        .await
        .unwrap()
}

/// Granted claims in the read model: user -> claim ids.
async fn granted(app: &TestApp, promotion: Uuid) -> HashMap<Uuid, Vec<Uuid>> {
    app.project().await;
    let client = crate::helpers::connect(&app.settings).await;
    let mut by_user: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
    for row in client
        .query(
            "SELECT user_id, claim_id FROM promotion_claims
              WHERE promotion_id = $1 AND status = 'granted' AND credited_at IS NOT NULL",
            &[&promotion],
        )
        .await
        .unwrap()
    {
        by_user.entry(row.get(0)).or_default().push(row.get(1));
    }
    by_user
}

#[tokio::test]
async fn two_thousand_claims_on_a_stock_of_a_hundred_through_two_processes() {
    let app = spawn_sale_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 100, "0").await;
    let claimers = users(&app, 2_000).await;
    let tokens: Vec<String> = claimers.iter().map(|(_, token)| token.clone()).collect();
    let answers = claim_all(&[&app, &other], promotion, &tokens).await;

    let accepted: Vec<usize> = (0..answers.len())
        .filter(|index| answers[*index].0 == 202)
        .collect();
    let sold_out = answers
        .iter()
        .filter(|(status, body)| *status == 409 && body["type"] == "/problems/sold-out")
        .count();
    assert_eq!((accepted.len(), sold_out), (100, 1_900));
    assert!(
        accepted
            .iter()
            .all(|index| answers[*index].1["status"] == "pending")
    );
    let claim_ids: HashSet<&str> = accepted
        .iter()
        .map(|index| answers[*index].1["claim_id"].as_str().unwrap())
        .collect();
    assert_eq!(claim_ids.len(), 100, "claim ids are unique");
    assert_eq!(left_at_gate(&app, promotion).await, Some(0));

    // Both processes' consumers persist them; each exactly once.
    assert_eq!(consume_all(&[&app, &other]).await, 100);
    let granted = granted(&app, promotion).await;
    assert_eq!(granted.len(), 100);
    assert!(granted.values().all(|claims| claims.len() == 1));
    let winners: HashSet<Uuid> = accepted
        .iter()
        .map(|index| claimers[*index].0.as_uuid())
        .collect();
    assert_eq!(granted.keys().copied().collect::<HashSet<_>>(), winners);

    // A winner sees the claim granted and the points; the read model and the events agree.
    let (winner_id, winner) = &claimers[accepted[0]];
    let mine: Value = app
        .get_as(winner, &format!("/api/v1/promotions/{promotion}/claims/me"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(mine["status"], "granted", "{mine}");
    let balance: Value = other
        .get_as(winner, "/api/v1/account")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(balance["available"], "10.00", "{winner_id}");
    let shown: Value = app
        .get_as(&admin, &format!("/api/v1/admin/promotions/{promotion}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&shown["granted"], &shown["left"]),
        (&json!(100), &json!(0))
    );
    let printed = app.cli(&["promotions", "show", &promotion.to_string(), "--json"]);
    assert!(printed.status.success(), "{printed:?}");
    let printed: Value = serde_json::from_slice(&printed.stdout).unwrap();
    assert_eq!(
        (&printed["granted"], &printed["left_at_gate"]),
        (&json!(100), &json!(0))
    );
    assert_eq!(printed["claims"].as_array().unwrap().len(), 100);
    project_and_verify(&app).await;
}

#[tokio::test]
async fn every_user_firing_five_claims_at_once_still_gets_at_most_one() {
    let app = spawn_sale_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 100, "0").await;
    let claimers = users(&app, 400).await;
    let tokens: Vec<String> = claimers
        .iter()
        .flat_map(|(_, token)| std::iter::repeat_n(token.clone(), 5))
        .collect();
    let answers = claim_all(&[&app, &other], promotion, &tokens).await;
    let mut accepted_per_user: HashMap<usize, usize> = HashMap::new();
    for (index, (status, body)) in answers.iter().enumerate() {
        match status {
            202 => *accepted_per_user.entry(index / 5).or_default() += 1,
            409 => assert!(
                body["type"] == "/problems/sold-out" || body["type"] == "/problems/already-claimed",
                "{body}"
            ),
            other => panic!("{other}: {body}"),
        }
    }
    assert_eq!(accepted_per_user.len(), 100);
    assert!(accepted_per_user.values().all(|count| *count == 1));
    consume_all(&[&app, &other]).await;
    let granted = granted(&app, promotion).await;
    assert_eq!(granted.len(), 100);
    assert!(granted.values().all(|claims| claims.len() == 1));
    project_and_verify(&app).await;
}

#[tokio::test]
async fn a_dead_consumers_claims_are_taken_over_and_granted_once() {
    let app = spawn_sale_app().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 50, "0").await;
    let early = users(&app, 30).await;
    let tokens: Vec<String> = early.iter().map(|(_, token)| token.clone()).collect();
    let answers = claim_all(&[&app], promotion, &tokens).await;
    assert!(
        answers.iter().all(|(status, _)| *status == 202),
        "{answers:?}"
    );
    // A consumer reads them and dies before persisting any (nothing acknowledged).
    let services = app.services();
    let mut redis = services.redis.connection().await.unwrap();
    services
        .promotions
        .consume_once("warm-up", None)
        .await
        .unwrap();
    let second = users(&app, 20).await;
    let tokens: Vec<String> = second.iter().map(|(_, token)| token.clone()).collect();
    claim_all(&[&app], promotion, &tokens).await;
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("persist")
        .arg("dead")
        .arg("COUNT")
        .arg(100)
        .arg("STREAMS")
        .arg(services.promotions.stream_key())
        .arg(">")
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(read.keys[0].ids.len(), 20, "the dead consumer held 20");
    // New entries: none for anyone else; the dead one's are taken over (idle bound 0 here).
    assert_eq!(
        services
            .promotions
            .consume_once("alive", None)
            .await
            .unwrap()
            .read,
        0
    );
    let taken = services.promotions.take_over_once("alive").await.unwrap();
    assert_eq!((taken.read, taken.acknowledged), (20, 20));
    assert_eq!(
        services
            .promotions
            .take_over_once("alive")
            .await
            .unwrap()
            .read,
        0
    );
    // Persisting one again (a consumer that died after persisting, before acknowledging) moves
    // nothing twice.
    let entry = ClaimEntry::parse(&read.keys[0].ids[0]).unwrap();
    services.promotions.persist(&entry).await.unwrap();
    let granted = granted(&app, promotion).await;
    assert_eq!(granted.len(), 50);
    assert!(granted.values().all(|claims| claims.len() == 1));
    project_and_verify(&app).await;
}

#[tokio::test]
async fn redis_flushed_mid_sale_still_grants_exactly_the_stock() {
    let app = spawn_app_with(|settings| {
        settings.promotions.consumer_batch = 10;
        settings.promotions.takeover_idle_ms = 0;
    })
    .await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 100, "0").await;
    let first = users(&app, 60).await;
    let tokens: Vec<String> = first.iter().map(|(_, token)| token.clone()).collect();
    assert!(
        claim_all(&[&app], promotion, &tokens)
            .await
            .iter()
            .all(|(status, _)| *status == 202)
    );
    // 30 of the 60 persisted, then Redis loses everything (its stream and group too): the 30
    // accepted and not persisted are lost with it (their users may claim again).
    let services = app.services();
    for _ in 0..3 {
        services.promotions.consume_once("c", None).await.unwrap();
    }
    flush_redis(&app).await;
    assert_eq!(left_at_gate(&app, promotion).await, None);

    // The gate rebuilds from the events: 30 taken, 70 left; the 30 persisted cannot claim again,
    // the 30 lost may.
    let persisted: HashSet<Uuid> = granted(&app, promotion).await.into_keys().collect();
    assert_eq!(persisted.len(), 30);
    let (kept, lost): (Vec<_>, Vec<_>) = first
        .iter()
        .partition(|(user_id, _)| persisted.contains(&user_id.as_uuid()));
    let again = claim_all(
        &[&app],
        promotion,
        &kept
            .iter()
            .map(|(_, token)| token.clone())
            .collect::<Vec<_>>(),
    )
    .await;
    assert!(
        again
            .iter()
            .all(|(status, body)| *status == 409 && body["type"] == "/problems/already-claimed")
    );
    assert_eq!(left_at_gate(&app, promotion).await, Some(70));
    let more = users(&app, 150).await;
    let tokens: Vec<String> = lost
        .iter()
        .copied()
        .chain(&more)
        .map(|(_, token)| token.clone())
        .collect();
    let answers = claim_all(&[&app], promotion, &tokens).await;
    assert_eq!(
        answers.iter().filter(|(status, _)| *status == 202).count(),
        70
    );
    loop {
        let report = services.promotions.consume_once("c", None).await.unwrap();
        if report.read == 0 {
            break;
        }
    }
    let granted = granted(&app, promotion).await;
    assert_eq!(granted.len(), 100, "exactly the stock overall");
    assert!(granted.values().all(|claims| claims.len() == 1));
    project_and_verify(&app).await;
}

#[tokio::test]
async fn a_price_is_charged_or_the_claim_refused_and_its_unit_given_back() {
    let app = spawn_sale_app().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 2, "3").await;
    let rich_id = app.register("rich", "a long password").await;
    let rich = app.login("rich", "a long password").await;
    let grant = app
        .post(
            &format!("/api/v1/admin/accounts/{rich_id}/grants"),
            Some(&admin),
            &json!({"amount": "5", "reason": "test"}),
        )
        .await;
    assert_eq!(grant.status(), 201);
    let poor = users(&app, 1).await.remove(0).1;
    let answers = claim_all(&[&app], promotion, &[rich.clone(), poor.clone()]).await;
    assert!(answers.iter().all(|(status, _)| *status == 202));
    assert_eq!(left_at_gate(&app, promotion).await, Some(0));
    consume_all(&[&app]).await;

    let balance: Value = app
        .get_as(&rich, "/api/v1/account")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(balance["available"], "12.00", "5 - 3 + 10");
    // The claim's view trails the consumer by the projection (the socket hears it at once).
    app.project().await;
    let mine_projected: Value = app
        .get_as(&poor, &format!("/api/v1/promotions/{promotion}/claims/me"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&mine_projected["status"], &mine_projected["reason"]),
        (&json!("refused"), &json!("insufficient-points"))
    );
    // The refused claim's unit is back at the gate: someone else gets it.
    assert_eq!(left_at_gate(&app, promotion).await, Some(1));
    let late = users(&app, 1).await.remove(0).1;
    assert_eq!(claim_all(&[&app], promotion, &[late]).await[0].0, 202);
    project_and_verify(&app).await;
}

#[tokio::test]
async fn every_refusal_is_named_and_a_claim_that_keeps_failing_is_parked() {
    let app = spawn_sale_app().await;
    let admin = app.admin_token("admin").await;
    let now = app.clock.now();
    let later: Value = app
        .post(
            "/api/v1/admin/promotions",
            Some(&admin),
            &json!({
                "title": "Tomorrow", "points": "10", "price": "0", "stock": 5,
                "starts_at": now + chrono::Duration::hours(1),
                "ends_at": now + chrono::Duration::hours(2),
            }),
        )
        .await
        .json()
        .await
        .unwrap();
    let (_, token) = users(&app, 1).await.remove(0);
    let not_open = app
        .post(
            &format!(
                "/api/v1/promotions/{}/claims",
                later["promotion_id"].as_str().unwrap()
            ),
            Some(&token),
            &json!({}),
        )
        .await;
    assert_eq!(not_open.status(), 409);
    let problem: Value = not_open.json().await.unwrap();
    assert_eq!(problem["type"], "/problems/not-open");
    assert!(problem["valid_from"].is_string(), "{problem}");
    let unknown = app
        .post(
            &format!("/api/v1/promotions/{}/claims", Uuid::now_v7()),
            Some(&token),
            &json!({}),
        )
        .await;
    assert_eq!(unknown.status(), 404);
    for (body, field) in [
        (
            json!({"title": "", "points": "1", "price": "0", "stock": 1, "starts_at": now, "ends_at": now + chrono::Duration::hours(1)}),
            "title",
        ),
        (
            json!({"title": "x", "points": "1", "price": "0", "stock": 0, "starts_at": now, "ends_at": now + chrono::Duration::hours(1)}),
            "stock",
        ),
        (
            json!({"title": "x", "points": "0", "price": "0", "stock": 1, "starts_at": now, "ends_at": now + chrono::Duration::hours(1)}),
            "points",
        ),
        (
            json!({"title": "x", "points": "1", "price": "0", "stock": 1, "starts_at": now, "ends_at": now}),
            "ends_at",
        ),
    ] {
        let response = app
            .post("/api/v1/admin/promotions", Some(&admin), &body)
            .await;
        assert_eq!(response.status(), 422, "{body}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["field"], field, "{problem}");
    }

    // An entry that cannot be persisted (here: not even read) is retried, then parked.
    let promotion = create_promotion(&app, &admin, 5, "0").await;
    let services = app.services();
    let mut redis = services.redis.connection().await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg(services.promotions.stream_key())
        .arg("*")
        .arg("claim")
        .arg("not-a-uuid")
        .arg("promotion")
        .arg(promotion.to_string())
        .query_async(&mut redis)
        .await
        .unwrap();
    let first = services.promotions.consume_once("c", None).await.unwrap();
    assert_eq!((first.read, first.failed), (1, 1));
    let retried = services.promotions.take_over_once("c").await.unwrap();
    assert_eq!((retried.read, retried.failed, retried.parked), (1, 1, 0));
    let parked = services.promotions.take_over_once("c").await.unwrap();
    assert_eq!(parked.parked, 1);
    assert_eq!(
        services.promotions.take_over_once("c").await.unwrap().read,
        0
    );
    let shown: Value = app
        .get_as(&admin, &format!("/api/v1/admin/promotions/{promotion}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(shown["parked"].as_array().unwrap().len(), 1, "{shown}");
    assert!(
        shown["parked"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("invalid"),
        "{shown}"
    );
}

#[tokio::test]
async fn the_claimer_hears_the_outcome_on_its_socket_and_nobody_else_does() {
    let app = spawn_sale_app().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 1, "0").await;
    let mut claimers = users(&app, 2).await;
    let (_, other) = claimers.pop().unwrap();
    let (_, token) = claimers.pop().unwrap();
    let mut socket = app.socket(&token).await;
    let mut other_socket = app.socket(&other).await;
    let answers = claim_all(&[&app], promotion, std::slice::from_ref(&token)).await;
    assert_eq!(answers[0].0, 202);
    consume_all(&[&app]).await;
    let frame = text_frame(&mut socket, std::time::Duration::from_secs(10))
        .await
        .expect("a frame");
    assert_eq!(
        (&frame["type"], &frame["claim_id"]),
        (&json!("claim_granted"), &answers[0].1["claim_id"])
    );
    assert_eq!(
        text_frame(&mut other_socket, std::time::Duration::from_millis(300)).await,
        None,
        "another user hears nothing"
    );
}

/// The next text frame (pings skipped) within `limit`, as JSON.
async fn text_frame<S>(socket: &mut S, limit: std::time::Duration) -> Option<Value>
where
    S: futures::Stream<
            Item = Result<
                async_tungstenite::tungstenite::Message,
                async_tungstenite::tungstenite::Error,
            >,
        > + Unpin,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let frame = tokio::time::timeout_at(deadline, socket.next())
            .await
            .ok()??
            .unwrap();
        if let async_tungstenite::tungstenite::Message::Text(text) = frame {
            return Some(serde_json::from_str(&text).unwrap());
        }
    }
}

#[tokio::test]
async fn a_claim_whose_entry_was_lost_midway_is_finished_by_the_reconciler() {
    let app = spawn_sale_app().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 5, "0").await;
    let (user_id, _) = users(&app, 1).await.remove(0);
    let services = app.services_on_app_clock();
    // Reserved (and, being free, granted) by a consumer, then Redis flushed: the entry and the
    // credit lost.
    let claim_id = Uuid::now_v7();
    services
        .promotions
        .execute(
            promotion,
            zhihui_domain::promotion::PromotionCommand::Reserve {
                claim_id,
                user_id,
                accepted_at: app.clock.now(),
                at: app.clock.now(),
            },
            zhihui::cli::bench_support::metadata(),
        )
        .await
        .unwrap();
    flush_redis(&app).await;
    app.project().await;
    let verified = app.verify(None).await;
    assert_eq!(
        (verified.differences.len(), verified.pending_settlements),
        (0, 1),
        "{:?}",
        verified.differences
    );
    let late = app.verify(Some(chrono::Duration::zero())).await;
    assert!(
        late.differences
            .iter()
            .any(|d| d.detail.contains("granted and never credited")),
        "{:?}",
        late.differences
    );
    app.clock.advance(std::time::Duration::from_millis(
        app.settings.tasks.settlement_after_ms + 1,
    ));
    let reconciler = zhihui::points::settlements::SettlementReconciler::new(
        services.tasks.clone(),
        services.codes.clone(),
        services.checkins.clone(),
        services.promotions.clone(),
        services.pg_pool.clone(),
        services.clock.clone(),
    );
    let report = reconciler.reconcile_once().await.unwrap();
    assert_eq!(report.repairs.len(), 1, "{report:?}");
    assert_eq!(
        (report.repairs[0].kind.as_str(), report.repairs[0].claim_id),
        ("claim_settled", Some(claim_id))
    );
    let granted = granted(&app, promotion).await;
    assert_eq!(granted.get(&user_id.as_uuid()), Some(&vec![claim_id]));
    assert!(
        reconciler
            .reconcile_once()
            .await
            .unwrap()
            .repairs
            .is_empty()
    );
    project_and_verify(&app).await;
}

#[tokio::test]
async fn the_consumers_blocking_read_never_holds_the_shared_connection() {
    let app = spawn_sale_app().await;
    let services = app.services();
    // Make the stream and the group exist, then block on it (nothing to read) for 3 s.
    services.promotions.consume_once("c", None).await.unwrap();
    let consumer = {
        let promotions = services.promotions.clone();
        tokio::spawn(async move { promotions.consume_once("c", Some(3_000)).await })
    };
    let stream = services.promotions.stream_key();
    let started = std::time::Instant::now();
    loop {
        let mut info_clients = redis::cmd("INFO");
        info_clients.arg("clients");
        let info: String = services
            .redis
            .query_on_node_of(&stream, info_clients)
            .await
            .unwrap();
        if info
            .lines()
            .any(|line| line.starts_with("blocked_clients:") && line != "blocked_clients:0")
        {
            break;
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        tokio::task::yield_now().await;
    }
    // While the read blocks, the process's shared connection answers at once.
    let asked = std::time::Instant::now();
    let mut shared = services.redis.connection().await.unwrap();
    let _: String = redis::cmd("PING").query_async(&mut shared).await.unwrap();
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(1),
        "a PING waited {:?} behind the consumer",
        asked.elapsed()
    );
    assert_eq!(consumer.await.unwrap().unwrap().read, 0);
}

/// Redis of `app`, for a test that puts the gate's cache a moment behind the store.
async fn gate_connection(app: &TestApp) -> zhihui::platform::redis_store::RedisConnection {
    crate::helpers::redis_of(&app.settings).await
}

/// The claim as its user reads it, once projected.
async fn my_claim(app: &TestApp, token: &str, promotion: Uuid) -> Value {
    app.project().await;
    app.get_as(token, &format!("/api/v1/promotions/{promotion}/claims/me"))
        .await
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_claim_the_gate_let_by_as_the_sale_ended_or_sold_out_is_turned_away_not_left_pending() {
    use zhihui_domain::promotion::{Promotion, PromotionCommand, promotion_stream};
    let app = spawn_sale_app().await;
    let other = app.another_instance().await;
    let admin = app.admin_token("admin").await;
    let promotion = create_promotion(&app, &admin, 3, "0").await;
    let people = users(&app, 4).await;
    let token = |n: usize| people[n].1.clone();
    assert_eq!(claim_all(&[&app], promotion, &[token(0)]).await[0].0, 202);
    app.clock.advance(std::time::Duration::from_secs(1));

    // The end is recorded in the store; the gate has not heard yet (an admin's end between its
    // append and its Redis step): a claim gets through.
    let services = app.services();
    zhihui::platform::command::execute::<Promotion>(
        &services.event_store,
        &promotion_stream(promotion),
        &PromotionCommand::End {
            at: app.clock.now(),
        },
        &crate::tasks::metadata(),
        Default::default(),
    )
    .await
    .unwrap();
    app.clock.advance(std::time::Duration::from_secs(1));
    assert_eq!(claim_all(&[&other], promotion, &[token(1)]).await[0].0, 202);
    consume_all(&[&app, &other]).await;

    assert_eq!(
        my_claim(&app, &token(0), promotion).await["status"],
        "granted"
    );
    let late = my_claim(&other, &token(1), promotion).await;
    assert_eq!(
        (&late["status"], &late["reason"]),
        (&json!("refused"), &json!("not-open")),
        "{late}"
    );
    project_and_verify(&app).await;

    // A gate counting more units than the store holds (a stale cache): the claims past the
    // stock are turned away as sold out, and the gate keeps those units taken.
    let promotion = create_promotion(&app, &admin, 1, "0").await;
    assert_eq!(claim_all(&[&app], promotion, &[token(2)]).await[0].0, 202);
    consume_all(&[&app]).await;
    let mut redis = gate_connection(&app).await;
    let _: () = redis::cmd("HSET")
        .arg(services.redis.tagged("promo", &promotion.to_string()))
        .arg("left")
        .arg(2)
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(left_at_gate(&app, promotion).await, Some(2));
    assert_eq!(claim_all(&[&other], promotion, &[token(3)]).await[0].0, 202);
    consume_all(&[&other, &app]).await;
    let sold_out = my_claim(&app, &token(3), promotion).await;
    assert_eq!(
        (&sold_out["status"], &sold_out["reason"]),
        (&json!("refused"), &json!("sold-out")),
        "{sold_out}"
    );
    assert_eq!(
        left_at_gate(&app, promotion).await,
        Some(1),
        "the unit kept taken"
    );
    project_and_verify(&app).await;
}
