//! The creators' gallery under load, each figure beside its peer measured in the same run, on
//! one PostgreSQL and one Redis:
//!
//! 1. **Likes on one hot work**: LIKERS distinct users from CLIENTS clients split over two
//!    instances (each its own pools and caches, as two `zhihui serve` processes), each like a
//!    real command (the work's stream read, the pair's like appended, the like set and the
//!    ranking written); then a hundred of those likers like again on both instances at once.
//!    Each design first makes WARM_UP likes on another work (connections opened, statements
//!    planned), not counted. The measured figure is taken with what a server runs beside its
//!    requests running on both instances, as `zhihui serve` starts it: every projection and the
//!    gallery worker (one leader each), which read every like and write it again into the read
//!    models and Redis, on the same cores; how long they took to catch up after the last like is
//!    printed. The same likes without them (on another work, before they start) are printed
//!    too: the figure earlier runs reported.
//!    Exactly LIKERS must be counted, in Redis and (after the projection) in `works`. Beside the
//!    plain SQL design: one transaction per like that inserts a unique (work, user) row and, when
//!    it was new, runs `UPDATE works SET likes = likes + 1` (the row lock every like waits on);
//!    its counter is its read model, written in the like's transaction.
//! 2. **Cached pages from outside**: `zhihui serve` (the release binary) under wrk (2 threads,
//!    64 connections): a work's page and the hot page, beside `GET /health` (the framework's
//!    ceiling) on the same server; the server's own count of works read from their source
//!    during the runs (`zhihui_gallery_cache_loads_total`, the only PostgreSQL reads these routes
//!    make), and the same work read by the plain SQL design (one query per request, 64 clients).
//! 3. **Breakdown**: 1,000 concurrent reads of a work whose cached copy went stale, split over
//!    two instances: how many rebuilds (source reads). Then the same with no copy at all.
//! 4. **Penetration**: 10,000 reads of 1,000 random ids that name no work: source reads per
//!    distinct id.
//! 5. **The feed**: a reader following FOLLOWED creators (two works each): p50/p99 of the first
//!    page and of a scroll, pushed (inbox) and pulled (every creator read at feed time), beside
//!    the plain SQL feed (a join of follows and works, newest first).
//! 6. **Publishing to many followers**: a work pushed into FAN_OUT live inboxes (the push cost,
//!    per follower), beside the pull cost per feed read of one pulled creator: where the
//!    cut-over between push and pull belongs.
//!
//! The tasks the works come from are written straight into their streams (submitted, succeeded)
//! and the followers of step 6 straight into Redis: fixtures, not what is measured. `audit
//! verify` then checks the gallery's read models against the events (the seeded tasks have no
//! account movements, so only the gallery's own checks are counted).
//!
//!     DATABASE_URL=postgres://zhihui@127.0.0.1:55432/zhihui REDIS_URL=redis://127.0.0.1:56379/0 \
//!         cargo build --release -p zhihui -p zhihui-bench && \
//!         target/release/bench_gallery [SECONDS_PER_CASE (default 5)]

#![allow(clippy::print_stdout, clippy::print_stderr)]

#[path = "../serve/mod.rs"]
mod serve;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::seq::SliceRandom;
use redis::AsyncCommands;
use rust_decimal::Decimal;
use secrecy::SecretString;
use uuid::Uuid;
use zhihui::cli::bench_support::{Figure, metadata, ms, percentile};
use zhihui::gallery::reads::Cursor;
use zhihui::gallery::worker::GalleryWorker;
use zhihui::gallery::{GalleryService, PublishRequest};
use zhihui::platform::configuration::Settings;
use zhihui::platform::event_store::{EventStore, ExpectedVersion};
use zhihui::state::AppState;
use zhihui_domain::points::Amount;
use zhihui_domain::task::{
    TaskEvent, TaskImage, TaskSpec, TaskSubmitted, TaskSucceeded, task_stream,
};
use zhihui_domain::user::UserId;

const CLIENTS: usize = 64;
const LIKERS: usize = 10_000;
/// Likes made before each design is measured (its connections opened, its statements planned).
const WARM_UP: usize = 2_000;
const POOL_SIZE: usize = 32;
const FOLLOWED: usize = 500;
const FEED_READS: usize = 2_000;
const FAN_OUT: usize = 100_000;
const STALE_READERS: usize = 1_000;
const MISSING_IDS: usize = 1_000;
const MISSING_READS: usize = 10_000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    zhihui::platform::allocator::tune();
    let seconds = zhihui::cli::bench_support::seconds_per_case()?;
    let redis_url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:56379/0".into());
    Box::pin(zhihui::cli::bench_support::with_fresh_database(
        |settings| {
            settings.database.pool_max_size = POOL_SIZE / 2;
            settings.event_store.group_commit_writers = 2;
            settings.redis.url = SecretString::from(redis_url);
            settings.redis.key_prefix = format!("bench:{}", Uuid::now_v7().simple());
            settings.log.filter = "warn".into();
        },
        |settings| async move { Box::pin(run(&settings, seconds)).await },
    ))
    .await
}

fn instance(settings: &Settings) -> anyhow::Result<AppState> {
    let pool = zhihui::platform::postgres::build_pool(&settings.database)?;
    AppState::build(settings, pool, Default::default())
}

/// What `zhihui serve` runs beside its requests that reads likes, started on `state`: every
/// projection and the gallery worker, each led by one process at a time (the other instance's
/// runner waits for the lead). Aborted, a runner drops its connections and its lead with them.
fn background(state: &AppState, settings: &Settings) -> Vec<tokio::task::JoinHandle<()>> {
    let mut runners = zhihui::startup::spawn_projections(state, &settings.projections);
    let worker = GalleryWorker::new(state.gallery.clone(), settings.projections.clone());
    runners.push(tokio::spawn(async move {
        if let Err(error) = worker.run().await {
            eprintln!("the gallery worker stopped: {error:#}");
        }
    }));
    runners
}

/// Wait until no projection has a committed event left to apply (at most a minute): how long it
/// took.
async fn projections_caught_up(state: &AppState) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let lags = zhihui::platform::projector::lags(&state.event_store, &state.pg_pool).await?;
        if lags.iter().all(|lag| lag.events == 0) {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "the projections did not catch up within a minute: {lags:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A task of `owner` that succeeded with two images, written into its stream (a fixture).
async fn seeded_task(state: &AppState, owner: UserId, prompt: &str) -> anyhow::Result<Uuid> {
    let task_id = Uuid::now_v7();
    let now = chrono::Utc::now();
    let events = vec![
        TaskEvent::Submitted(Box::new(TaskSubmitted {
            task_id,
            user_id: owner,
            spec: TaskSpec {
                model: "majicmixRealistic_v7.safetensors".into(),
                width: 512,
                height: 512,
                steps: 20,
                cfg: Decimal::new(70, 1),
                sampler: "euler".into(),
                scheduler: "karras".into(),
                seed: 42,
                images: 2,
            },
            prompt: zhihui_domain::task::PromptText::parse(prompt, 1_000, false)
                .map_err(|error| anyhow::anyhow!("{error}"))?,
            negative_prompt: zhihui_domain::task::PromptText::parse("", 1_000, true)
                .map_err(|error| anyhow::anyhow!("{error}"))?,
            prompt_used: prompt.into(),
            negative_prompt_used: String::new(),
            price: Amount::whole(1),
            workflow: serde_json::json!({}).into(),
            request_digest: "bench".into(),
            at: now,
        })),
        TaskEvent::Succeeded(TaskSucceeded {
            images: (0..2)
                .map(|index| TaskImage {
                    image_id: zhihui::dispatch::images::image_id(task_id, index).to_string(),
                    content_type: "image/png".into(),
                })
                .collect(),
            at: now,
        }),
    ];
    state
        .event_store
        .append(
            &task_stream(task_id),
            ExpectedVersion::NoStream,
            zhihui::platform::command::to_new_events(&events, &metadata()),
        )
        .await?;
    Ok(task_id)
}

/// A user's registration, written into its stream (a fixture: follows need the creator to be
/// registered).
async fn registered(state: &AppState, user: UserId) -> anyhow::Result<()> {
    let events = vec![zhihui_domain::user::UserEvent::Registered(
        zhihui_domain::user::UserRegistered {
            user_id: user,
            username: Some(
                zhihui_domain::user::Username::parse(&format!(
                    "c{}",
                    &user.as_uuid().simple().to_string()[..24]
                ))
                .map_err(|error| anyhow::anyhow!("{error}"))?,
            ),
            password_hash: None,
            phone: None,
            role: zhihui_domain::user::Role::User,
            registered_at: chrono::Utc::now(),
        },
    )];
    state
        .event_store
        .append(
            &user.stream(),
            ExpectedVersion::NoStream,
            zhihui::platform::command::to_new_events(&events, &metadata()),
        )
        .await?;
    Ok(())
}

async fn publish(
    gallery: &GalleryService,
    state: &AppState,
    owner: UserId,
    title: &str,
) -> anyhow::Result<Uuid> {
    let task_id = seeded_task(state, owner, "一只在雪地里奔跑的红狐狸").await?;
    gallery
        .publish(
            owner,
            PublishRequest {
                task_id,
                images: Vec::new(),
                title: title.into(),
                description: String::new(),
                prompt_shown: true,
            },
            &metadata(),
        )
        .await
        .map_err(|error| anyhow::anyhow!("publishing: {error}"))
}

/// `count` distinct new users like `work` from CLIENTS clients, every other one on `b`: the time
/// it took, each like's latency, and the users.
async fn like_all(
    a: &GalleryService,
    b: &GalleryService,
    work: Uuid,
    count: usize,
) -> anyhow::Result<(f64, Vec<Duration>, Vec<UserId>)> {
    let likers: Arc<Vec<UserId>> = Arc::new(
        (0..count)
            .map(|_| UserId::from_uuid(Uuid::now_v7()))
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let gallery = if client % 2 == 0 {
            a.clone()
        } else {
            b.clone()
        };
        let (likers, next) = (likers.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(user) = likers.get(index) else {
                    return anyhow::Ok(latencies);
                };
                let sent = Instant::now();
                gallery
                    .like(*user, work, &metadata())
                    .await
                    .map_err(|error| anyhow::anyhow!("a like: {error}"))?;
                latencies.push(sent.elapsed());
            }
        }));
    }
    let mut latencies = Vec::new();
    for client in clients {
        latencies.extend(client.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((elapsed, latencies, Arc::unwrap_or_clone(likers)))
}

fn p(samples: &mut [Duration], at: f64) -> f64 {
    samples.sort();
    percentile(samples, at).map_or(0.0, ms)
}

async fn run(settings: &Settings, seconds: u64) -> anyhow::Result<Vec<Figure>> {
    let a = instance(settings)?;
    zhihui::platform::postgres::migrate(&a.pg_pool).await?;
    let b = instance(settings)?;
    let mut figures: Vec<Figure> = Vec::new();

    // 1. Likes on one hot work.
    let creator = UserId::from_uuid(Uuid::now_v7());
    let work = publish(&a.gallery, &a, creator, "热门作品").await?;
    // Warm-up, on another work and not counted: both instances' connections opened and their
    // statements planned, as in a server that has been running (the peer warms up alike).
    let warm = publish(&a.gallery, &a, creator, "热身").await?;
    let bare_work = publish(&a.gallery, &a, creator, "没有后台的作品").await?;
    like_all(&a.gallery, &b.gallery, warm, WARM_UP).await?;
    // The same likes with nothing else running: what earlier runs measured.
    let (bare_elapsed, mut bare_latencies, _) =
        like_all(&a.gallery, &b.gallery, bare_work, LIKERS).await?;
    let bare = LIKERS as f64 / bare_elapsed;
    let bare_p99 = p(&mut bare_latencies, 0.99);
    // Then as a server runs: the projections and the gallery worker on both instances, caught
    // up with everything before (the warm-up's likes and the bare run's) before the clock starts.
    let runners: Vec<_> = background(&a, settings)
        .into_iter()
        .chain(background(&b, settings))
        .collect();
    projections_caught_up(&a).await?;
    let (elapsed, mut latencies, likers) = like_all(&a.gallery, &b.gallery, work, LIKERS).await?;
    let ours = LIKERS as f64 / elapsed;
    let ours_p99 = p(&mut latencies, 0.99);
    let catch_up = projections_caught_up(&a).await?;
    for runner in &runners {
        runner.abort();
    }
    for runner in runners {
        let _ = runner.await;
    }
    // Double clicks: a hundred likers like again, on both instances at once.
    let mut again = Vec::new();
    for user in likers.iter().take(100) {
        for gallery in [&a.gallery, &b.gallery] {
            let gallery = gallery.clone();
            let user = *user;
            again.push(tokio::spawn(async move {
                gallery.like(user, work, &metadata()).await
            }));
        }
    }
    for like in again {
        like.await?
            .map_err(|error| anyhow::anyhow!("a repeated like: {error}"))?;
    }
    let counted = a.gallery.like_counts(&[work]).await?[0];
    anyhow::ensure!(
        counted == LIKERS as u64,
        "counted {counted} likes, not {LIKERS}"
    );
    let (peer, peer_p99) = row_lock_likes(settings).await?;
    println!("| likes on one work, {LIKERS} users, {CLIENTS} clients | per second | p99 ms |");
    println!("|---|---|---|");
    println!(
        "| zhihui (pair streams, Redis like set), two instances, projections and gallery worker running | {ours:.0} | {ours_p99:.2} |"
    );
    println!(
        "| the same, nothing else running (another work, before they started) | {bare:.0} | {bare_p99:.2} |"
    );
    println!("| plain SQL (unique row + UPDATE likes = likes + 1) | {peer:.0} | {peer_p99:.2} |");
    println!(
        "projections caught up {:.1} ms after the last like was answered",
        ms(catch_up)
    );
    println!("counted: {counted} (a hundred likers liked again on both instances: nothing added)");
    // The names earlier runs used keep the likes alone (their baseline compares like with like);
    // the likes as a server serves them have names of their own, and the target.
    figures.push(("gallery_likes_per_second".into(), bare, "likes/s"));
    figures.push(("gallery_likes_p99".into(), bare_p99, "ms"));
    figures.push(("gallery_likes_sql_peer_per_second".into(), peer, "likes/s"));
    figures.push(("gallery_likes_ratio_vs_row_lock".into(), bare / peer, "x"));
    figures.push(("gallery_likes_served_per_second".into(), ours, "likes/s"));
    figures.push(("gallery_likes_served_p99".into(), ours_p99, "ms"));
    figures.push((
        "gallery_likes_served_ratio_vs_row_lock".into(),
        ours / peer,
        "x",
    ));
    figures.push((
        "gallery_likes_projections_caught_up".into(),
        ms(catch_up),
        "ms",
    ));
    figures.push(("gallery_likes_counted".into(), counted as f64, "likes"));

    // 3. Breakdown: a stale copy, then no copy, read by 1,000 at once on two instances.
    let mut short = settings.clone();
    short.gallery.cache_ttl_ms = 200;
    let (c, d) = (instance(&short)?, instance(&short)?);
    let mut connection = a.redis.connection().await?;
    let _: i64 = connection.del(a.gallery.keys().view(work)).await?;
    c.gallery.card(work).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let before = c.gallery.card_source_loads() + d.gallery.card_source_loads();
    concurrent_reads(&c.gallery, &d.gallery, &vec![work; STALE_READERS]).await?;
    let stale_rebuilds = c.gallery.card_source_loads() + d.gallery.card_source_loads() - before;
    let (e, f) = (instance(&short)?, instance(&short)?);
    let _: i64 = connection.del(a.gallery.keys().view(work)).await?;
    let before = e.gallery.card_source_loads() + f.gallery.card_source_loads();
    concurrent_reads(&e.gallery, &f.gallery, &vec![work; STALE_READERS]).await?;
    let cold_loads = e.gallery.card_source_loads() + f.gallery.card_source_loads() - before;
    println!(
        "breakdown: {STALE_READERS} concurrent reads of a stale copy: {stale_rebuilds} rebuild(s); with no copy: {cold_loads} source read(s)"
    );
    figures.push((
        "gallery_stale_key_rebuilds".into(),
        stale_rebuilds as f64,
        "rebuilds",
    ));
    figures.push((
        "gallery_cold_key_source_reads".into(),
        cold_loads as f64,
        "reads",
    ));

    // 4. Penetration: ids that name no work.
    let missing: Vec<Uuid> = (0..MISSING_IDS).map(|_| Uuid::now_v7()).collect();
    let mut reads: Vec<Uuid> = missing
        .iter()
        .cycle()
        .take(MISSING_READS)
        .copied()
        .collect();
    reads.shuffle(&mut rand::rng());
    let before = a.gallery.card_source_loads() + b.gallery.card_source_loads();
    concurrent_reads(&a.gallery, &b.gallery, &reads).await?;
    let missing_loads = a.gallery.card_source_loads() + b.gallery.card_source_loads() - before;
    println!(
        "penetration: {MISSING_READS} reads of {MISSING_IDS} missing ids: {missing_loads} source read(s), {:.2} per distinct id",
        missing_loads as f64 / MISSING_IDS as f64
    );
    figures.push((
        "gallery_missing_source_reads_per_id".into(),
        missing_loads as f64 / MISSING_IDS as f64,
        "reads",
    ));

    // 5. The feed: a reader following FOLLOWED creators with two works each.
    let reader = UserId::from_uuid(Uuid::now_v7());
    let creators: Vec<UserId> = (0..FOLLOWED)
        .map(|_| UserId::from_uuid(Uuid::now_v7()))
        .collect();
    for creator in &creators {
        registered(&a, *creator).await?;
        a.gallery
            .follow(reader, *creator, &metadata())
            .await
            .map_err(|error| anyhow::anyhow!("a follow: {error}"))?;
    }
    // The reader reads their feed once (their inbox is live), then the creators publish.
    a.gallery.feed(reader, None, 24).await?;
    let worker = GalleryWorker::new(a.gallery.clone(), settings.projections.clone());
    worker.catch_up().await?;
    for (index, creator) in creators.iter().enumerate() {
        for round in 0..2 {
            publish(&a.gallery, &a, *creator, &format!("作品 {index}-{round}")).await?;
        }
    }
    worker.catch_up().await?;
    zhihui::cli::bench_support::project_and_audit(&a, settings).await?;
    let (pushed_first, pushed_scroll) = feed_latencies(&a.gallery, reader).await?;
    let mut pulled = settings.clone();
    pulled.gallery.push_followers_max = 0;
    let pull = instance(&pulled)?;
    // Every creator pulled: mark them so (as a follow past the limit would) and drop the inbox.
    let _: i64 = connection
        .sadd(
            a.gallery.keys().famous(),
            creators.iter().map(ToString::to_string).collect::<Vec<_>>(),
        )
        .await?;
    let _: i64 = connection.del(a.gallery.keys().inbox(reader)).await?;
    let (pulled_first, pulled_scroll) = feed_latencies(&pull.gallery, reader).await?;
    let _: i64 = connection.del(a.gallery.keys().famous()).await?;
    let sql_feed = sql_feed_latencies(&a, reader).await?;
    println!(
        "| feed of {FOLLOWED} followed creators | first page p50 ms | p99 ms | scroll page p99 ms |"
    );
    println!("|---|---|---|---|");
    println!(
        "| pushed (inbox) | {:.2} | {:.2} | {:.2} |",
        pushed_first.0, pushed_first.1, pushed_scroll
    );
    println!(
        "| pulled (every creator at read time) | {:.2} | {:.2} | {:.2} |",
        pulled_first.0, pulled_first.1, pulled_scroll
    );
    println!(
        "| plain SQL (follows JOIN works, ids only) | {:.2} | {:.2} | |",
        sql_feed.0, sql_feed.1
    );
    figures.push(("gallery_feed_push_p99".into(), pushed_first.1, "ms"));
    figures.push(("gallery_feed_pull_p99".into(), pulled_first.1, "ms"));
    figures.push(("gallery_feed_sql_peer_p99".into(), sql_feed.1, "ms"));

    // 6. Publishing to FAN_OUT followers: the push's cost per follower, the pull's per read.
    let star = UserId::from_uuid(Uuid::now_v7());
    let fans: Vec<UserId> = (0..FAN_OUT)
        .map(|_| UserId::from_uuid(Uuid::now_v7()))
        .collect();
    for chunk in fans.chunks(5_000) {
        let mut pipe = redis::pipe();
        for fan in chunk {
            pipe.zadd(a.gallery.keys().followers(star), fan.to_string(), 1)
                .ignore();
            pipe.cmd("SET")
                .arg(a.gallery.keys().inbox_live(*fan))
                .arg(1)
                .arg("EX")
                .arg(3_600)
                .ignore();
        }
        pipe.query_async::<()>(&mut connection).await?;
    }
    let mut unlimited = settings.clone();
    unlimited.gallery.push_followers_max = u32::MAX;
    let pusher = instance(&unlimited)?;
    let push_worker = GalleryWorker::new(pusher.gallery.clone(), settings.projections.clone());
    let star_work = Uuid::now_v7();
    let started = Instant::now();
    let pushed = push_worker
        .push(star, star_work, chrono::Utc::now())
        .await?;
    let push_seconds = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        pushed == FAN_OUT as u64,
        "pushed into {pushed} inboxes, not {FAN_OUT}"
    );
    let push_us_per_follower = push_seconds * 1e6 / FAN_OUT as f64;
    let pull_us_per_read = ((pulled_first.0 - pushed_first.0).max(0.0) * 1000.0) / FOLLOWED as f64;
    println!(
        "publish to {FAN_OUT} followers by push: {:.0} ms ({push_us_per_follower:.1} µs per follower); pull: {pull_us_per_read:.1} µs per feed read per pulled creator (from the feed's p50s above)",
        push_seconds * 1000.0
    );
    // Push costs once per publish per follower; pull costs on every feed read of every
    // follower. With F followers each reading R times between two of the creator's works, push
    // is cheaper while push_us < R * pull_us, whatever F: a famous creator is pulled because
    // one publish must not stall the worker for F * push_us.
    figures.push((
        "gallery_push_ms_100k_followers".into(),
        push_seconds * 1000.0,
        "ms",
    ));
    figures.push((
        "gallery_push_us_per_follower".into(),
        push_us_per_follower,
        "us",
    ));
    figures.push((
        "gallery_pull_us_per_read_per_creator".into(),
        pull_us_per_read,
        "us",
    ));

    // 2. Cached pages from outside, under wrk.
    figures.extend(external(settings, work, seconds).await?);

    // The gallery's read models against the events.
    let verified = zhihui::cli::bench_support::project_and_audit(&a, settings).await?;
    let gallery_differences = verified
        .differences
        .iter()
        .filter(|difference| {
            matches!(
                difference.read_model,
                "gallery" | "works" | "work_likes" | "follows"
            )
        })
        .count();
    println!("audit verify, the gallery's checks: {gallery_differences} difference(s)");
    anyhow::ensure!(
        gallery_differences == 0,
        "the gallery's read models disagree with the events"
    );
    let row: i64 = a
        .pg_pool
        .get()
        .await?
        .query_one("SELECT like_count FROM works WHERE work_id = $1", &[&work])
        .await?
        .get(0);
    anyhow::ensure!(
        row == LIKERS as i64,
        "works.like_count is {row}, not {LIKERS}"
    );
    zhihui::cli::bench_support::clean_redis(&a).await?;
    Ok(figures)
}

/// Reads of `ids` (cards) from CLIENTS clients over two instances, all at once.
async fn concurrent_reads(
    one: &GalleryService,
    two: &GalleryService,
    ids: &[Uuid],
) -> anyhow::Result<()> {
    let ids = Arc::new(ids.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for client in 0..CLIENTS.max(ids.len().min(1_000)) {
        let gallery = if client % 2 == 0 {
            one.clone()
        } else {
            two.clone()
        };
        let (ids, next) = (ids.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(index) else {
                    return anyhow::Ok(());
                };
                gallery.card(*id).await?;
            }
        }));
    }
    for client in clients {
        client.await??;
    }
    Ok(())
}

/// The first page's (p50, p99) and a scroll page's p99 of `reader`'s feed.
async fn feed_latencies(
    gallery: &GalleryService,
    reader: UserId,
) -> anyhow::Result<((f64, f64), f64)> {
    let first_page = gallery.feed(reader, None, 24).await?;
    anyhow::ensure!(
        first_page.works.len() == 24,
        "a feed page of {}",
        first_page.works.len()
    );
    let second: Option<Cursor> = first_page.next.as_deref().and_then(Cursor::parse);
    let mut first = Vec::with_capacity(FEED_READS);
    let mut scroll = Vec::with_capacity(FEED_READS);
    for _ in 0..FEED_READS {
        let started = Instant::now();
        gallery.feed(reader, None, 24).await?;
        first.push(started.elapsed());
        let started = Instant::now();
        gallery.feed(reader, second, 24).await?;
        scroll.push(started.elapsed());
    }
    Ok((
        (p(&mut first, 0.5), p(&mut first, 0.99)),
        p(&mut scroll, 0.99),
    ))
}

/// The plain SQL feed: the newest 24 works of the creators `reader` follows, ids only.
async fn sql_feed_latencies(state: &AppState, reader: UserId) -> anyhow::Result<(f64, f64)> {
    let client = state.pg_pool.get().await?;
    let statement = client
        .prepare(
            "SELECT w.work_id FROM follows f
               JOIN works w ON w.creator = f.creator AND w.status = 'published'
              WHERE f.follower = $1 ORDER BY w.published_at DESC, w.work_id DESC LIMIT 24",
        )
        .await?;
    let mut samples = Vec::with_capacity(FEED_READS);
    for _ in 0..FEED_READS {
        let started = Instant::now();
        let rows = client.query(&statement, &[&reader.as_uuid()]).await?;
        samples.push(started.elapsed());
        anyhow::ensure!(rows.len() == 24, "the SQL feed found {}", rows.len());
    }
    Ok((p(&mut samples, 0.5), p(&mut samples, 0.99)))
}

/// The plain SQL design of a like: a unique (work, user) row, and the counter on the work's row
/// (every like waits for the one before on that row's lock).
async fn row_lock_likes(settings: &Settings) -> anyhow::Result<(f64, f64)> {
    let manager =
        deadpool_postgres::Manager::new(settings.database.pg_config()?, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(POOL_SIZE)
        .build()?;
    let client = pool.get().await?;
    client
        .batch_execute(
            "CREATE TABLE peer_works (work_id uuid PRIMARY KEY, likes bigint NOT NULL);
             CREATE TABLE peer_likes (work_id uuid NOT NULL, user_id uuid NOT NULL,
                 liked_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (work_id, user_id));",
        )
        .await?;
    // Warm-up on another work, as zhihui's likes are warmed up.
    let warm = Uuid::now_v7();
    client
        .execute("INSERT INTO peer_works VALUES ($1, 0)", &[&warm])
        .await?;
    let work = Uuid::now_v7();
    client
        .execute("INSERT INTO peer_works VALUES ($1, 0)", &[&work])
        .await?;
    drop(client);
    row_lock_like_all(&pool, warm, WARM_UP).await?;
    let (elapsed, mut latencies) = row_lock_like_all(&pool, work, LIKERS).await?;
    let rate = LIKERS as f64 / elapsed;
    let counted: i64 = pool
        .get()
        .await?
        .query_one("SELECT likes FROM peer_works WHERE work_id = $1", &[&work])
        .await?
        .get(0);
    anyhow::ensure!(counted == LIKERS as i64, "the SQL peer counted {counted}");
    Ok((rate, p(&mut latencies, 0.99)))
}

/// `count` distinct new users like `work` the plain SQL way from CLIENTS clients: the time it
/// took and each like's latency.
async fn row_lock_like_all(
    pool: &deadpool_postgres::Pool,
    work: Uuid,
    count: usize,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (pool, next) = (pool.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                if next.fetch_add(1, Ordering::Relaxed) >= count {
                    return anyhow::Ok(latencies);
                }
                let user = Uuid::now_v7();
                let sent = Instant::now();
                let mut client = pool.get().await?;
                let insert = client
                    .prepare_cached("INSERT INTO peer_likes (work_id, user_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
                    .await?;
                let increment = client
                    .prepare_cached("UPDATE peer_works SET likes = likes + 1 WHERE work_id = $1")
                    .await?;
                let transaction = client.transaction().await?;
                if transaction.execute(&insert, &[&work, &user]).await? == 1 {
                    transaction.execute(&increment, &[&work]).await?;
                }
                transaction.commit().await?;
                latencies.push(sent.elapsed());
            }
        }));
    }
    let mut latencies = Vec::new();
    for client in clients {
        latencies.extend(client.await??);
    }
    Ok((started.elapsed().as_secs_f64(), latencies))
}

/// The server's count of works read from their source.
async fn source_loads(http: &reqwest::Client, base: &str) -> anyhow::Result<f64> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    text.lines()
        .find_map(|line| line.strip_prefix("zhihui_gallery_cache_loads_total "))
        .and_then(|value| value.trim().parse().ok())
        .context("no zhihui_gallery_cache_loads_total in /metrics")
}

async fn external(settings: &Settings, work: Uuid, seconds: u64) -> anyhow::Result<Vec<Figure>> {
    let available = std::process::Command::new("wrk")
        .arg("--version")
        .output()
        .is_ok();
    if !available {
        println!(
            "wrk is not installed (apt-get install wrk): the cached pages were not measured from outside"
        );
        return Ok(Vec::new());
    }
    let server = serve::start_server(settings, &[("ZHIHUI_PROJECTIONS__ENABLED", "false")]).await?;
    let base = server.base.clone();
    let http = reqwest::Client::new();
    let work_url = format!("{base}/api/v1/gallery/works/{work}");
    let hot_url = format!("{base}/api/v1/gallery/hot");
    for url in [&work_url, &hot_url] {
        let response = http.get(url.as_str()).send().await?;
        anyhow::ensure!(
            response.status().is_success(),
            "{url}: {}",
            response.status()
        );
    }
    let loads_before = source_loads(&http, &base).await?;
    let health = wrk_run(seconds, &format!("{base}/health")).await?;
    let work_page = wrk_run(seconds, &work_url).await?;
    let hot_page = wrk_run(seconds, &hot_url).await?;
    let loads = source_loads(&http, &base).await? - loads_before;
    let sql = sql_work_reads(settings, work, seconds).await?;
    println!("| request, wrk 2 threads 64 connections | 2xx per second | p99 ms | errors |");
    println!("|---|---|---|---|");
    println!(
        "| GET /health (the ceiling) | {:.0} | {:.2} | {} |",
        health.0, health.1, health.2
    );
    println!(
        "| GET /api/v1/gallery/works/{{id}} | {:.0} | {:.2} | {} |",
        work_page.0, work_page.1, work_page.2
    );
    println!(
        "| GET /api/v1/gallery/hot | {:.0} | {:.2} | {} |",
        hot_page.0, hot_page.1, hot_page.2
    );
    println!(
        "| plain SQL: the work's row and its like count, 64 clients in process | {sql:.0} | | |"
    );
    println!("works read from their source during the wrk runs: {loads}");
    drop(server);
    Ok(vec![
        (
            "gallery_work_page_per_second".into(),
            work_page.0,
            "requests/s",
        ),
        (
            "gallery_hot_page_per_second".into(),
            hot_page.0,
            "requests/s",
        ),
        (
            "gallery_health_ceiling_per_second".into(),
            health.0,
            "requests/s",
        ),
        (
            "gallery_work_page_share_of_ceiling".into(),
            work_page.0 / health.0,
            "x",
        ),
        ("gallery_sql_work_reads_per_second".into(), sql, "reads/s"),
        ("gallery_steady_state_source_reads".into(), loads, "reads"),
        (
            "gallery_work_page_errors".into(),
            work_page.2 as f64,
            "requests",
        ),
        (
            "gallery_hot_page_errors".into(),
            hot_page.2 as f64,
            "requests",
        ),
    ])
}

/// wrk's (2xx per second, p99 ms, errors: error answers and requests without one) for `url`.
async fn wrk_run(seconds: u64, url: &str) -> anyhow::Result<(f64, f64, u64)> {
    let output = tokio::process::Command::new("wrk")
        .args(["-t2", "-c64", &format!("-d{seconds}s"), "--latency", url])
        .output()
        .await?;
    let run =
        zhihui::cli::bench_support::WrkOutput::parse(&String::from_utf8_lossy(&output.stdout))?;
    Ok((run.ok_per_second(), run.p99_ms, run.errors()))
}

/// The plain SQL design of a work's page: its row and its like count, read per request.
async fn sql_work_reads(settings: &Settings, work: Uuid, seconds: u64) -> anyhow::Result<f64> {
    let manager =
        deadpool_postgres::Manager::new(settings.database.pg_config()?, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(POOL_SIZE)
        .build()?;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let done = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (pool, done) = (pool.clone(), done.clone());
        clients.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let client = pool.get().await?;
                let statement = client
                    .prepare_cached(
                        "SELECT w.title, w.images, w.like_count, u.username FROM works w
                           LEFT JOIN users u ON u.user_id = w.creator WHERE w.work_id = $1",
                    )
                    .await?;
                client.query_opt(&statement, &[&work]).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    for client in clients {
        client.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / seconds as f64)
}
