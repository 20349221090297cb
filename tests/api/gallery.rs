//! The creators' gallery end to end: publishing (and a hidden prompt that never leaves the
//! server, not even inside the image file), likes once per user under races on two processes,
//! hiding seen by every process at once, follows and the feed (pushed and pulled, scrolled
//! without skips or repeats), the read models against `audit verify`, and Redis written back from
//! the events after a flush by `zhihui gallery rebuild`.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use comfyui_sim::Faults;
use serde_json::{Value, json};
use zhihui_domain::task::TaskStatus;

use crate::dispatch::{
    Harness, drive_until, drive_until_connected, drive_until_idle, harness_configured,
};
use crate::helpers::{TestApp, flush_redis};
use crate::tasks::{funded_user, submit};

const PROMPT: &str = "雨后的江南小镇，青石板路，撑油纸伞的少女，水墨风格";
const NEGATIVE: &str = "模糊，低质量，多余的手指";

pub(crate) async fn gallery_harness(
    customise: impl FnOnce(&mut zhihui::platform::configuration::Settings) + Send + 'static,
) -> Harness {
    harness_configured(1, Faults::default(), customise).await
}

/// Tasks of `token` run to success; their ids.
pub(crate) async fn succeeded_tasks(harness: &Harness, token: &str, count: usize) -> Vec<String> {
    let app = &harness.app;
    let mut tasks = Vec::new();
    for _ in 0..count {
        let response = submit(
            app,
            token,
            &json!({"prompt": PROMPT, "negative_prompt": NEGATIVE, "images": 2, "steps": 2}),
            None,
        )
        .await;
        assert_eq!(response.status(), 201);
        let body: Value = response.json().await.unwrap();
        tasks.push(body["task_id"].as_str().unwrap().to_owned());
    }
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    drive_until(&mut saga, &process, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;
    saga.resign().await;
    tasks
}

/// A user without points (likes and follows cost nothing): (id, token).
pub(crate) async fn member(app: &TestApp, name: &str) -> (String, String) {
    let user = app.register(name, "correct horse battery").await;
    (user, app.login(name, "correct horse battery").await)
}

pub(crate) async fn publish(
    app: &TestApp,
    token: &str,
    task: &str,
    title: &str,
    prompt_shown: bool,
) -> String {
    let response = app
        .post(
            "/api/v1/gallery/works",
            Some(token),
            &json!({"task_id": task, "title": title, "description": "第一次发布\n请多指教", "prompt_shown": prompt_shown}),
        )
        .await;
    assert_eq!(response.status(), 201, "{}", response.text().await.unwrap());
    let body: Value = response.json().await.unwrap();
    body["work_id"].as_str().unwrap().to_owned()
}

pub(crate) async fn send(
    app: &TestApp,
    method: reqwest::Method,
    path: &str,
    token: &str,
) -> reqwest::Response {
    app.http
        .request(method, format!("{}{path}", app.address))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

pub(crate) async fn json_of(response: reqwest::Response) -> Value {
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{status}: {text}");
    serde_json::from_str(&text).unwrap()
}

fn ids(page: &Value) -> Vec<String> {
    page["works"]
        .as_array()
        .unwrap()
        .iter()
        .map(|work| work["work_id"].as_str().unwrap().to_owned())
        .collect()
}

/// `reader` follows `creator`, its first follower; the creator's id.
async fn follow_first(app: &TestApp, creator: &str, reader: &str) -> String {
    let creator_id = json_of(app.get_as(creator, "/api/v1/me").await).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let follow = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{creator_id}/follow"),
        reader,
    )
    .await;
    assert_eq!(json_of(follow).await["followers"], 1);
    creator_id
}

pub(crate) fn gallery_worker(app: &TestApp) -> zhihui::gallery::worker::GalleryWorker {
    zhihui::gallery::worker::GalleryWorker::new(
        app.services().gallery,
        app.settings.projections.clone(),
    )
}

/// PNG chunks as (type, data).
fn png_chunks(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let mut chunks = Vec::new();
    let mut at = 8;
    while at + 8 <= bytes.len() {
        let length = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let kind = String::from_utf8_lossy(&bytes[at + 4..at + 8]).into_owned();
        chunks.push((kind, bytes[at + 8..at + 8 + length].to_vec()));
        at += 12 + length;
    }
    chunks
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[tokio::test]
async fn a_prompt_its_creator_hid_leaves_the_server_nowhere_and_publishing_refuses_what_it_must() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, token) = funded_user(app, "xiaolin", "100").await;
    let (_, other) = funded_user(app, "passerby", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &token, 2)).await;
    let hidden = publish(app, &token, &tasks[0], "江南烟雨", false).await;
    let shown = publish(app, &token, &tasks[1], "江南烟雨·其二", true).await;
    // Sent again: the same work, nothing new.
    assert_eq!(
        publish(app, &token, &tasks[0], "江南烟雨", false).await,
        hidden
    );

    // Every answer anyone can get about the hidden one carries no trace of the prompt.
    let work = json_of(app.get(&format!("/api/v1/gallery/works/{hidden}")).await).await;
    assert_eq!(work["title"], "江南烟雨");
    assert_eq!(work["creator_name"], "xiaolin");
    assert!(
        work.get("prompt").is_none() && work.get("negative_prompt").is_none(),
        "{work}"
    );
    assert_eq!(work["settings"]["steps"], 2);
    let shown_work = json_of(app.get(&format!("/api/v1/gallery/works/{shown}")).await).await;
    assert_eq!(shown_work["prompt"], PROMPT);
    assert_eq!(shown_work["negative_prompt"], NEGATIVE);
    for path in [
        format!("/api/v1/gallery/works/{hidden}"),
        "/api/v1/gallery/new".to_owned(),
        "/api/v1/gallery/hot".to_owned(),
    ] {
        for caller in [None, Some(other.as_str()), Some(token.as_str())] {
            let response = match caller {
                None => app.get(&path).await,
                Some(token) => app.get_as(token, &path).await,
            };
            let text = response.text().await.unwrap();
            assert!(text.contains(&hidden), "{path}: {text}");
            if path.ends_with(&hidden) {
                assert!(
                    !text.contains("江南小镇") && !text.contains("多余的手指"),
                    "{path}: {text}"
                );
            }
        }
    }
    // The public image file: the AIGC labels are there, ComfyUI's prompt and workflow are not.
    for image in work["images"].as_array().unwrap() {
        let response = app.get(image.as_str().unwrap()).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-aigc-label"], "1");
        assert_eq!(response.headers()["cache-control"], "public, no-cache");
        let bytes = response.bytes().await.unwrap().to_vec();
        let chunks = png_chunks(&bytes);
        let text_chunks: Vec<String> = chunks
            .iter()
            .filter(|(kind, _)| matches!(kind.as_str(), "tEXt" | "iTXt" | "zTXt"))
            .map(|(kind, data)| {
                let keyword = data.split(|byte| *byte == 0).next().unwrap();
                format!("{kind} {}", String::from_utf8_lossy(keyword))
            })
            .collect();
        assert_eq!(
            text_chunks,
            ["tEXt AIGC", "iTXt XML:com.adobe.xmp"],
            "{chunks:?}"
        );
        for needle in [PROMPT, NEGATIVE, "江南", "KSampler", "CLIPTextEncode"] {
            assert!(
                !contains(&bytes, needle.as_bytes()),
                "{needle} inside the image"
            );
        }
        let found = zhihui::labels::metadata::read(&bytes).unwrap();
        assert_eq!(found.png_text.unwrap().label, "1");
    }
    // Another's image id through this work: not served.
    let foreign = app
        .get(&format!(
            "/api/v1/gallery/works/{hidden}/images/{}",
            uuid::Uuid::now_v7()
        ))
        .await;
    assert_eq!(foreign.status(), 404);

    // Refusals name their rule; nothing is written for them.
    let long = "长".repeat(61);
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &json!({"task_id": tasks[0], "title": "  ", "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 422);
    assert!(refused.text().await.unwrap().contains("title"));
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &json!({"task_id": tasks[0], "title": long, "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 422);
    assert!(refused.text().await.unwrap().contains("at most 60"));
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&other),
            &json!({"task_id": tasks[0], "title": "偷来的", "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 404, "another's task is no task");
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &json!({"task_id": tasks[0], "title": "改个名字", "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 409);
    assert!(refused.text().await.unwrap().contains("already-published"));
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &json!({"task_id": tasks[1], "images": ["not-an-image"], "title": "x", "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 422);
    // A long id is named, not echoed whole.
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &json!({"task_id": tasks[1], "images": ["图".repeat(5_000)], "title": "x", "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 422);
    let text = refused.text().await.unwrap();
    assert!(text.len() < 1_000 && text.contains("图图…"), "{text}");
    // A task that has not succeeded (still queued: nothing leads the dispatcher now).
    let queued = submit(app, &token, &json!({"prompt": PROMPT, "steps": 2}), None).await;
    let queued: Value = queued.json().await.unwrap();
    let refused = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &json!({"task_id": queued["task_id"], "title": "还没画完", "prompt_shown": true}),
        )
        .await;
    assert_eq!(refused.status(), 409);
    assert!(refused.text().await.unwrap().contains("task-not-succeeded"));
    // Following oneself, an unknown creator, a visitor liking.
    let me: Value = json_of(app.get_as(&token, "/api/v1/me").await).await;
    let myself = send(
        app,
        reqwest::Method::PUT,
        &format!(
            "/api/v1/gallery/creators/{}/follow",
            me["id"].as_str().unwrap()
        ),
        &token,
    )
    .await;
    assert_eq!(myself.status(), 422);
    assert!(myself.text().await.unwrap().contains("following-oneself"));
    let nobody = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{}/follow", uuid::Uuid::now_v7()),
        &token,
    )
    .await;
    assert_eq!(nobody.status(), 404);
    // An unknown creator has no page and no works (not an empty list).
    let unknown = uuid::Uuid::now_v7();
    for path in [
        format!("/api/v1/gallery/creators/{unknown}"),
        format!("/api/v1/gallery/creators/{unknown}/works"),
    ] {
        assert_eq!(app.get(&path).await.status(), 404, "{path}");
    }
    let visitor = app
        .http
        .put(format!(
            "{}/api/v1/gallery/works/{hidden}/like",
            app.address
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(visitor.status(), 401);

    app.project().await;
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}

#[tokio::test]
async fn a_double_like_on_two_processes_counts_once_and_the_counts_hold_everywhere() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, token) = funded_user(app, "creator", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &token, 1)).await;
    let work = publish(app, &token, &tasks[0], "双击测试", true).await;
    let second = app.another_instance().await;
    let (_, fan) = member(app, "fan_one").await;

    // Twenty likes of one user at once, through both processes.
    let path = format!("/api/v1/gallery/works/{work}/like");
    let answers = futures::future::join_all((0..20).map(|index| {
        let process = if index % 2 == 0 { app } else { &second };
        send(process, reqwest::Method::PUT, &path, &fan)
    }))
    .await;
    for answer in answers {
        let body = json_of(answer).await;
        assert_eq!(body["likes"], 1, "{body}");
        assert_eq!(body["liked"], true);
    }
    let store = app.services().event_store;
    let fan_id: Value = json_of(app.get_as(&fan, "/api/v1/me").await).await;
    let stream = format!("like-{work}-{}", fan_id["id"].as_str().unwrap());
    let events = zhihui::platform::event_store::read_whole_stream(&store, &stream)
        .await
        .unwrap();
    assert_eq!(events.len(), 1, "one like recorded");

    // Unlike and like again, racing on both processes: it ends liked or not, counted right.
    let answers = futures::future::join_all((0..10).map(|index| {
        let process = if index % 2 == 0 { app } else { &second };
        let method = if index % 3 == 0 {
            reqwest::Method::DELETE
        } else {
            reqwest::Method::PUT
        };
        send(process, method, &path, &fan)
    }))
    .await;
    for answer in answers {
        assert!(answer.status().is_success());
    }
    let events = zhihui::platform::event_store::read_whole_stream(&store, &stream)
        .await
        .unwrap();
    let liked_now = events.last().unwrap().event_type == "WorkLiked";
    // Whatever the order, no two likes (or unlikes) follow each other on the stream.
    for pair in events.windows(2) {
        assert_ne!(pair[0].event_type, pair[1].event_type, "{events:?}");
    }

    // Many users, from both processes: each counted once.
    let mut fans = vec![fan.clone()];
    for index in 0..12 {
        let (_, token) = member(app, &format!("fan{index}")).await;
        fans.push(token);
    }
    let answers =
        futures::future::join_all(fans.iter().skip(1).enumerate().map(|(index, token)| {
            let process = if index % 2 == 0 { app } else { &second };
            send(process, reqwest::Method::PUT, &path, token)
        }))
        .await;
    for answer in answers {
        assert!(answer.status().is_success());
    }
    let expected = 12 + u64::from(liked_now);
    for process in [app, &second] {
        let view = json_of(
            process
                .get_as(&fans[3], &format!("/api/v1/gallery/works/{work}"))
                .await,
        )
        .await;
        assert_eq!(view["likes"], expected, "{view}");
        assert_eq!(view["liked"], true);
        assert_eq!(view["first_likers"].as_array().unwrap().len(), 5);
    }
    // The earliest likers first.
    let view = json_of(app.get(&format!("/api/v1/gallery/works/{work}")).await).await;
    assert!(view.get("liked").is_none(), "a visitor has no like");
    // The user's likes, from the read model.
    app.project().await;
    let mine = json_of(app.get_as(&fans[3], "/api/v1/gallery/likes").await).await;
    assert_eq!(ids(&mine), std::slice::from_ref(&work));
    let client = crate::helpers::connect(&app.settings).await;
    let row = client
        .query_one(
            "SELECT like_count FROM works WHERE work_id = $1",
            &[&uuid::Uuid::parse_str(&work).unwrap()],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0) as u64, expected);
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );

    // Likes are paced per user.
    let paced = gallery_harness(|settings| settings.gallery.likes_per_minute = 2).await;
    let (_, quick) = member(&paced.app, "quick").await;
    let path = format!("/api/v1/gallery/works/{}/like", uuid::Uuid::now_v7());
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            send(&paced.app, reqwest::Method::PUT, &path, &quick)
                .await
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [404, 404, 429]);
}

#[tokio::test]
async fn a_hidden_work_leaves_every_list_cache_and_feed_on_both_processes_within_a_second() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let second = app.another_instance().await;
    let (_, creator) = funded_user(app, "shanshui", "100").await;
    let (_, reader) = member(app, "reader").await;
    let admin = app.admin_token("moderator").await;
    let creator_id = follow_first(app, &creator, &reader).await;
    // The reader has read the feed lately: their inbox is live and gets pushes.
    assert!(ids(&json_of(app.get_as(&reader, "/api/v1/gallery/feed").await).await).is_empty());
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 2)).await;
    let kept = publish(app, &creator, &tasks[0], "留下的", true).await;
    app.clock.advance(Duration::from_secs(60));
    let work = publish(app, &creator, &tasks[1], "将被隐藏", true).await;
    let worker = gallery_worker(app);
    worker.catch_up().await.unwrap();
    app.project().await;

    // Cached everywhere: each process's memory and Redis hold the card.
    for process in [app, &second] {
        assert_eq!(
            json_of(process.get(&format!("/api/v1/gallery/works/{work}")).await).await["title"],
            "将被隐藏"
        );
        assert_eq!(
            ids(&json_of(process.get("/api/v1/gallery/new").await).await),
            [work.clone(), kept.clone()]
        );
        let feed = json_of(process.get_as(&reader, "/api/v1/gallery/feed").await).await;
        assert_eq!(ids(&feed), [work.clone(), kept.clone()]);
    }
    // Its creator likes it before the hide.
    let like_path = format!("/api/v1/gallery/works/{work}/like");
    let liked = send(app, reqwest::Method::PUT, &like_path, &creator).await;
    assert_eq!(json_of(liked).await["likes"], 1);

    let hidden = app
        .post(
            &format!("/api/v1/admin/gallery/works/{work}/hide"),
            Some(&admin),
            &json!({"reason": "含有不适宜公开的内容"}),
        )
        .await;
    assert_eq!(hidden.status(), 204);
    let started = Instant::now();
    for process in [&second, app] {
        loop {
            let status = process
                .get(&format!("/api/v1/gallery/works/{work}"))
                .await
                .status();
            if status == 404 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "still served after a second"
            );
            tokio::task::yield_now().await;
        }
        for path in ["/api/v1/gallery/new", "/api/v1/gallery/hot"] {
            assert_eq!(
                ids(&json_of(process.get(path).await).await),
                std::slice::from_ref(&kept),
                "{path}"
            );
        }
        let feed = json_of(process.get_as(&reader, "/api/v1/gallery/feed").await).await;
        assert_eq!(ids(&feed), std::slice::from_ref(&kept));
        let creator_page = json_of(
            process
                .get(&format!("/api/v1/gallery/creators/{creator_id}/works"))
                .await,
        )
        .await;
        assert_eq!(ids(&creator_page), std::slice::from_ref(&kept));
        let image = process
            .get(&format!("/api/v1/gallery/works/{work}/images/x"))
            .await;
        assert_eq!(image.status(), 404);
    }
    // Likes on it are refused; its creator sees why it was hidden and cannot publish it again.
    let like = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/works/{work}/like"),
        &reader,
    )
    .await;
    assert_eq!(like.status(), 404);
    // Taking back a like one never gave tells nothing of it either (not its count, not that it
    // is there); a like given before the hide is taken back.
    let unlike = send(app, reqwest::Method::DELETE, &like_path, &reader).await;
    assert_eq!(unlike.status(), 404);
    assert!(!unlike.text().await.unwrap().contains("likes"));
    let taken_back = send(&second, reqwest::Method::DELETE, &like_path, &creator).await;
    assert_eq!(json_of(taken_back).await["liked"], false);
    app.project().await;
    let mine = json_of(app.get_as(&creator, "/api/v1/me/works").await).await;
    let row = mine
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["work_id"] == work.as_str())
        .unwrap();
    assert_eq!(row["status"], "hidden");
    assert_eq!(row["hidden_reason"], "含有不适宜公开的内容");
    // Its owner still sees its picture in their list; nobody else is served it.
    let cover = row["cover"].as_str().unwrap();
    assert!(cover.starts_with("/api/v1/images/"), "{row}");
    let picture = app.get_as(&creator, cover).await;
    assert_eq!(picture.status(), 200);
    assert!(
        picture.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("image/")
    );
    assert_eq!(app.get_as(&reader, cover).await.status(), 404);
    let again = app
        .post(
            "/api/v1/gallery/works",
            Some(&creator),
            &json!({"task_id": tasks[1], "title": "将被隐藏", "prompt_shown": true}),
        )
        .await;
    assert_eq!(again.status(), 409);
    assert!(again.text().await.unwrap().contains("含有不适宜公开的内容"));
    // The audit log keeps who hid it and why.
    let events = zhihui::platform::event_store::read_whole_stream(
        &app.services().event_store,
        &format!("work-{work}"),
    )
    .await
    .unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.event_type, "WorkHidden");
    assert!(
        last.metadata.actor.starts_with("admin:"),
        "{:?}",
        last.metadata
    );
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}

#[tokio::test]
async fn the_feed_scrolls_pushed_and_pulled_works_without_skips_or_repeats_and_a_rebuild_restores_redis()
 {
    // One creator with few followers (pushed), one with more than the push limit (pulled).
    let harness = gallery_harness(|settings| settings.gallery.push_followers_max = 2).await;
    let app = &harness.app;
    let (_, quiet) = funded_user(app, "quiet", "100").await;
    let (_, famous) = funded_user(app, "mingjia", "100").await;
    let (_, reader) = member(app, "follower").await;
    let quiet_id = json_of(app.get_as(&quiet, "/api/v1/me").await).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let famous_id = json_of(app.get_as(&famous, "/api/v1/me").await).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut followers_of_famous = vec![reader.clone()];
    for index in 0..3 {
        let (_, token) = member(app, &format!("viewer{index}")).await;
        followers_of_famous.push(token);
    }
    for token in &followers_of_famous {
        let done = send(
            app,
            reqwest::Method::PUT,
            &format!("/api/v1/gallery/creators/{famous_id}/follow"),
            token,
        )
        .await;
        assert!(done.status().is_success());
    }
    let done = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{quiet_id}/follow"),
        &reader,
    )
    .await;
    assert!(done.status().is_success());
    // A common follow: both the reader and one viewer follow the famous one.
    let profile = json_of(
        app.get_as(
            &followers_of_famous[1],
            &format!("/api/v1/gallery/creators/{quiet_id}"),
        )
        .await,
    )
    .await;
    assert_eq!(profile["followers"], 1);
    assert_eq!(profile["followed"], false);
    let profile = json_of(
        app.get_as(
            &followers_of_famous[1],
            &format!(
                "/api/v1/gallery/creators/{}",
                json_of(app.get_as(&reader, "/api/v1/me").await).await["id"]
                    .as_str()
                    .unwrap()
            ),
        )
        .await,
    )
    .await;
    assert_eq!(profile["following"], 2);
    assert_eq!(profile["common_follows"][0]["name"], "mingjia");
    let visitor = json_of(
        app.get(&format!("/api/v1/gallery/creators/{famous_id}"))
            .await,
    )
    .await;
    assert_eq!(visitor["followers"], 4);
    assert!(visitor.get("common_follows").is_none());

    // The reader reads the feed (their inbox is live), then both publish: three works each,
    // all at one instant (the test clock does not move), so the feed's scores tie.
    assert!(ids(&json_of(app.get_as(&reader, "/api/v1/gallery/feed").await).await).is_empty());
    let quiet_tasks = Box::pin(succeeded_tasks(&harness, &quiet, 3)).await;
    let famous_tasks = Box::pin(succeeded_tasks(&harness, &famous, 3)).await;
    let mut works = Vec::new();
    for (token, tasks) in [(&quiet, &quiet_tasks), (&famous, &famous_tasks)] {
        for (index, task) in tasks.iter().enumerate() {
            works.push(publish(app, token, task, &format!("作品{index}"), true).await);
        }
    }
    let worker = gallery_worker(app);
    worker.catch_up().await.unwrap();
    app.project().await;
    let services = app.services();
    let mut connection = services.redis.connection().await.unwrap();
    let reader_id = zhihui_domain::user::UserId::from_uuid(
        uuid::Uuid::parse_str(
            json_of(app.get_as(&reader, "/api/v1/me").await).await["id"]
                .as_str()
                .unwrap(),
        )
        .unwrap(),
    );
    let inbox: Vec<String> = redis::AsyncCommands::zrange(
        &mut connection,
        services.gallery.keys().inbox(reader_id),
        0,
        -1,
    )
    .await
    .unwrap();
    assert_eq!(
        inbox.len(),
        3,
        "only the quiet creator's works were pushed: {inbox:?}"
    );

    let scroll = |limit: usize| {
        let reader = reader.clone();
        async move {
            let mut seen = Vec::new();
            let mut cursor: Option<String> = None;
            for _ in 0..20 {
                let path = match &cursor {
                    None => format!("/api/v1/gallery/feed?limit={limit}"),
                    Some(cursor) => format!("/api/v1/gallery/feed?limit={limit}&cursor={cursor}"),
                };
                let page = json_of(app.get_as(&reader, &path).await).await;
                seen.extend(ids(&page));
                match page["next"].as_str() {
                    Some(next) => cursor = Some(next.to_owned()),
                    None => return seen,
                }
            }
            panic!("the feed never ended: {seen:?}");
        }
    };
    let mut expected = works.clone();
    expected.sort();
    for limit in [1, 2, 4, 10] {
        let mut seen = scroll(limit).await;
        assert_eq!(seen.len(), 6, "page size {limit}: {seen:?}");
        seen.sort();
        assert_eq!(seen, expected, "page size {limit}");
    }

    // The reader blocks the quiet creator: their works leave the reader's feed and lists (not
    // anyone else's), and the reader stops following them.
    let blocked = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{quiet_id}/block"),
        &reader,
    )
    .await;
    assert_eq!(json_of(blocked).await["blocked"], true);
    let quiet_works = &works[..3];
    let feed = json_of(app.get_as(&reader, "/api/v1/gallery/feed?limit=48").await).await;
    assert_eq!(ids(&feed).len(), 3, "{feed}");
    assert!(ids(&feed).iter().all(|id| !quiet_works.contains(id)));
    let newest = json_of(app.get_as(&reader, "/api/v1/gallery/new?limit=48").await).await;
    assert!(
        ids(&newest).iter().all(|id| !quiet_works.contains(id)),
        "{newest}"
    );
    let for_others = json_of(app.get("/api/v1/gallery/new?limit=48").await).await;
    assert_eq!(ids(&for_others).len(), 6);
    let profile = json_of(
        app.get_as(&reader, &format!("/api/v1/gallery/creators/{quiet_id}"))
            .await,
    )
    .await;
    assert_eq!(profile["blocked"], true);
    assert_eq!(profile["followed"], false);
    // Following a creator one blocked is refused, named, and changes nothing.
    let refollow = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{quiet_id}/follow"),
        &reader,
    )
    .await;
    assert_eq!(refollow.status(), 409);
    assert!(refollow.text().await.unwrap().contains("creator-blocked"));
    let profile = json_of(
        app.get_as(&reader, &format!("/api/v1/gallery/creators/{quiet_id}"))
            .await,
    )
    .await;
    assert_eq!(profile["followed"], false, "{profile}");
    let myself = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{reader_id}/block"),
        &reader,
    )
    .await;
    assert_eq!(myself.status(), 422);

    // A like or two, then Redis loses everything: the rebuild writes the same back. Read as a
    // signed-in viewer: a visitor's pages may come from the process's memory for a second.
    let viewer = &followers_of_famous[1];
    for token in &followers_of_famous {
        let liked = send(
            app,
            reqwest::Method::PUT,
            &format!("/api/v1/gallery/works/{}/like", works[4]),
            token,
        )
        .await;
        assert!(liked.status().is_success());
    }
    let unfollowed = send(
        app,
        reqwest::Method::DELETE,
        &format!("/api/v1/gallery/creators/{famous_id}/follow"),
        &followers_of_famous[3],
    )
    .await;
    assert_eq!(json_of(unfollowed).await["followers"], 3);
    let snapshot = || async {
        (
            json_of(app.get_as(viewer, "/api/v1/gallery/new?limit=48").await).await,
            json_of(app.get_as(viewer, "/api/v1/gallery/hot?limit=48").await).await,
            json_of(
                app.get_as(viewer, &format!("/api/v1/gallery/works/{}", works[4]))
                    .await,
            )
            .await,
            json_of(
                app.get(&format!("/api/v1/gallery/creators/{famous_id}"))
                    .await,
            )
            .await,
            json_of(app.get_as(&reader, "/api/v1/gallery/feed?limit=48").await).await,
            json_of(app.get_as(&reader, "/api/v1/gallery/new?limit=48").await).await,
        )
    };
    worker.catch_up().await.unwrap();
    app.project().await;
    worker.recompute_hot().await.unwrap();
    let before = snapshot().await;
    assert_eq!(before.2["likes"], 4);
    flush_redis(app).await;
    let output = app.cli(&["gallery", "rebuild"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(String::from_utf8_lossy(&output.stdout).contains("rebuilt the gallery"));
    let after = snapshot().await;
    assert_eq!(ids(&after.0), ids(&before.0));
    assert_eq!(ids(&after.1), ids(&before.1));
    assert_eq!(after.2["likes"], before.2["likes"]);
    assert_eq!(after.2["first_likers"], before.2["first_likers"]);
    assert_eq!(after.3, before.3);
    assert_eq!(
        ids(&after.4),
        ids(&before.4),
        "the inbox rebuilt when its owner came back"
    );
    assert_eq!(ids(&after.5), ids(&before.5), "the block rebuilt");
    assert_eq!(ids(&after.5).len(), 3);
    let unblocked = send(
        app,
        reqwest::Method::DELETE,
        &format!("/api/v1/gallery/creators/{quiet_id}/block"),
        &reader,
    )
    .await;
    assert_eq!(json_of(unblocked).await["blocked"], false);
    let newest = json_of(app.get_as(&reader, "/api/v1/gallery/new?limit=48").await).await;
    assert_eq!(ids(&newest).len(), 6);
    let refollow = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{quiet_id}/follow"),
        &reader,
    )
    .await;
    assert_eq!(json_of(refollow).await["following"], true);
    app.project().await;
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}

/// A reader who was away (no live inbox) comes back just after a creator they follow published:
/// the worker skipped them (pushes go to live inboxes only) and the works read model has not
/// caught up yet. The feed still shows the work: the inbox is rebuilt from the creators' lists the
/// publishing request wrote in Redis, not from the lagging read model.
#[tokio::test]
async fn a_reader_back_from_away_sees_a_work_published_while_the_read_model_lags() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "huajia", "100").await;
    let (_, reader) = member(app, "guike").await;
    follow_first(app, &creator, &reader).await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    app.project().await;
    let work = publish(app, &creator, &tasks[0], "归来的人", true).await;
    // The push: skipped, the reader's inbox is not live. No projection runs after the publish.
    gallery_worker(app).catch_up().await.unwrap();
    let feed = json_of(app.get_as(&reader, "/api/v1/gallery/feed").await).await;
    assert_eq!(ids(&feed), [work]);
}

/// The hot ranking is recomputed from the read model, which trails the lists: a work published
/// since the projection's last batch keeps its place in the ranking through a recompute.
#[tokio::test]
async fn a_work_the_read_model_has_not_reached_stays_ranked_through_a_recompute() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "huajia", "100").await;
    let (_, viewer) = member(app, "kanke").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 2)).await;
    app.project().await;
    let old = publish(app, &creator, &tasks[0], "江南春雨", true).await;
    app.project().await;
    let new = publish(app, &creator, &tasks[1], "塞北秋风", true).await;
    let worker = gallery_worker(app);
    worker.catch_up().await.unwrap();
    assert_eq!(
        worker.recompute_hot().await.unwrap(),
        1,
        "the read model has one"
    );
    let hot = json_of(app.get_as(&viewer, "/api/v1/gallery/hot").await).await;
    let mut ranked = ids(&hot);
    ranked.sort();
    let mut both = vec![old.clone(), new.clone()];
    both.sort();
    assert_eq!(ranked, both, "{hot}");
    // Once the read model has it, the recompute ranks it itself; a hidden work is not kept.
    app.project().await;
    assert_eq!(worker.recompute_hot().await.unwrap(), 2);
    let admin = app.admin_token("guanli").await;
    let hidden = app
        .post(
            &format!("/api/v1/admin/gallery/works/{new}/hide"),
            Some(&admin),
            &json!({"reason": "与作品说明不符"}),
        )
        .await;
    assert_eq!(hidden.status(), 204);
    worker.recompute_hot().await.unwrap();
    let hot = json_of(app.get_as(&viewer, "/api/v1/gallery/hot").await).await;
    assert_eq!(ids(&hot), [old], "{hot}");
}

/// The projection folds a run of likes into one statement per batch and the worker applies them
/// all at once: a pair that unlikes and likes again inside one batch keeps its row (with the new
/// time), one that unlikes goes, one that likes and unlikes there never shows, and each count
/// moves by what changed. After the like set is lost in Redis, the worker writes the same back.
#[tokio::test]
async fn likes_folded_in_one_batch_move_each_count_by_what_changed() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, token) = funded_user(app, "huajia", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &token, 1)).await;
    let work = publish(app, &token, &tasks[0], "一次批量的点赞", true).await;
    let path = format!("/api/v1/gallery/works/{work}/like");
    let mut fans = Vec::new();
    for name in ["xiaohong", "xiaoming", "xiaogang"] {
        fans.push(member(app, name).await);
    }
    let like = |token: &str, method: reqwest::Method| {
        let token = token.to_owned();
        let path = path.clone();
        async move {
            let answer = send(app, method, &path, &token).await;
            json_of(answer).await
        }
    };
    // The first batch: two likes.
    like(&fans[0].1, reqwest::Method::PUT).await;
    like(&fans[1].1, reqwest::Method::PUT).await;
    app.project().await;
    // The second batch: the first fan unlikes and likes again, the second unlikes, the third
    // likes and unlikes.
    like(&fans[0].1, reqwest::Method::DELETE).await;
    let again = like(&fans[0].1, reqwest::Method::PUT).await;
    assert_eq!(again["likes"], 2, "{again}");
    like(&fans[1].1, reqwest::Method::DELETE).await;
    like(&fans[2].1, reqwest::Method::PUT).await;
    let last = like(&fans[2].1, reqwest::Method::DELETE).await;
    assert_eq!(last["likes"], 1, "{last}");
    app.project().await;

    let client = crate::helpers::connect(&app.settings).await;
    let work_id = uuid::Uuid::parse_str(&work).unwrap();
    let count: i64 = client
        .query_one(
            "SELECT like_count FROM works WHERE work_id = $1",
            &[&work_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 1);
    let rows = client
        .query(
            "SELECT user_id, liked_at FROM work_likes WHERE work_id = $1",
            &[&work_id],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    let first_fan = uuid::Uuid::parse_str(&fans[0].0).unwrap();
    assert_eq!(rows[0].get::<_, uuid::Uuid>(0), first_fan);
    // The time of the like again, not of the first like.
    let store = app.services().event_store;
    let events = zhihui::platform::event_store::read_whole_stream(
        &store,
        &format!("like-{work}-{first_fan}"),
    )
    .await
    .unwrap();
    assert_eq!(events.len(), 3, "liked, unliked, liked again");
    let liked_again: Value = serde_json::from_str(events[2].payload.as_str()).unwrap();
    let liked_at: chrono::DateTime<chrono::Utc> = rows[0].get(1);
    // PostgreSQL keeps microseconds.
    assert_eq!(
        liked_at.timestamp_micros(),
        liked_again["liked_at"]
            .as_str()
            .unwrap()
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap()
            .timestamp_micros()
    );

    // Redis loses the like set: the worker's rebuild writes the same one back.
    let services = app.services();
    let keys = services.gallery.keys();
    let mut connection = services.redis.connection().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(keys.likes(work_id))
        .arg(keys.like_versions(work_id))
        .query_async(&mut connection)
        .await
        .unwrap();
    gallery_worker(app).rebuild().await.unwrap();
    let members: Vec<String> = redis::cmd("ZRANGE")
        .arg(keys.likes(work_id))
        .arg(0)
        .arg(-1)
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(members, [fans[0].0.clone()]);
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}

/// The feed lists the works of the creators the reader follows now: an unfollow takes a
/// creator's pushed works out of it at once, on both processes, and following again brings them
/// back.
#[tokio::test]
async fn an_unfollowed_creators_works_leave_the_feed_at_once_on_both_processes() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let second = app.another_instance().await;
    let (creator_id, creator) = funded_user(app, "shanshui", "100").await;
    let (_, reader) = member(app, "duzhe").await;
    let follow = format!("/api/v1/gallery/creators/{creator_id}/follow");
    assert!(
        send(app, reqwest::Method::PUT, &follow, &reader)
            .await
            .status()
            .is_success()
    );
    // Read once before publishing, so the inbox is live and the work is pushed into it.
    let empty = json_of(app.get_as(&reader, "/api/v1/gallery/feed").await).await;
    assert!(ids(&empty).is_empty());
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    let work = publish(app, &creator, &tasks[0], "关注之后的新作", true).await;
    gallery_worker(app).catch_up().await.unwrap();
    for process in [app, &second] {
        let feed = json_of(process.get_as(&reader, "/api/v1/gallery/feed").await).await;
        assert_eq!(ids(&feed), std::slice::from_ref(&work));
    }

    let unfollowed = send(&second, reqwest::Method::DELETE, &follow, &reader).await;
    assert_eq!(json_of(unfollowed).await["following"], false);
    for process in [app, &second] {
        let feed = json_of(process.get_as(&reader, "/api/v1/gallery/feed").await).await;
        assert!(ids(&feed).is_empty(), "{feed}");
    }
    assert!(
        send(app, reqwest::Method::PUT, &follow, &reader)
            .await
            .status()
            .is_success()
    );
    let feed = json_of(second.get_as(&reader, "/api/v1/gallery/feed").await).await;
    assert_eq!(ids(&feed), std::slice::from_ref(&work));
}

/// A reader whose feed is live (read lately) follows a creator who published before: the
/// creator's works are in the feed at once, on both processes, as for a reader who had never
/// opened it, and newest first among the works of those they followed before.
#[tokio::test]
async fn following_a_creator_brings_their_earlier_works_into_a_feed_already_read() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let second = app.another_instance().await;
    let (first_id, first) = funded_user(app, "xianlai", "100").await;
    let (creator_id, creator) = funded_user(app, "houlai", "100").await;
    let (_, reader) = member(app, "laoduzhe").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 2)).await;
    let mut earlier = vec![publish(app, &creator, &tasks[0], "早先的一幅山水", true).await];
    app.clock.advance(Duration::from_secs(1));
    earlier.push(publish(app, &creator, &tasks[1], "早先的一幅花鸟", true).await);
    let follow = |id: &str| format!("/api/v1/gallery/creators/{id}/follow");
    assert!(
        send(app, reqwest::Method::PUT, &follow(&first_id), &reader)
            .await
            .status()
            .is_success()
    );
    let empty = json_of(app.get_as(&reader, "/api/v1/gallery/feed").await).await;
    assert!(ids(&empty).is_empty(), "{empty}");
    app.clock.advance(Duration::from_secs(5));
    let first_tasks = Box::pin(succeeded_tasks(&harness, &first, 1)).await;
    let newest = publish(app, &first, &first_tasks[0], "关注之后的新作", true).await;
    gallery_worker(app).catch_up().await.unwrap();
    let live = json_of(second.get_as(&reader, "/api/v1/gallery/feed").await).await;
    assert_eq!(ids(&live), std::slice::from_ref(&newest));

    let followed = send(&second, reqwest::Method::PUT, &follow(&creator_id), &reader).await;
    assert_eq!(json_of(followed).await["following"], true);
    let expected = vec![newest.clone(), earlier[1].clone(), earlier[0].clone()];
    for process in [app, &second] {
        let feed = json_of(process.get_as(&reader, "/api/v1/gallery/feed").await).await;
        assert_eq!(ids(&feed), expected, "{feed}");
    }
    // The worker applying the follow again changes nothing.
    gallery_worker(app).catch_up().await.unwrap();
    let feed = json_of(app.get_as(&reader, "/api/v1/gallery/feed").await).await;
    assert_eq!(ids(&feed), expected, "{feed}");
}

/// One's own works page by a keyset cursor in the `Link` header, in the API and the pages: all
/// published at one instant (the test clock stands still), none skipped or repeated; a cursor
/// or limit that is not one is a 422 naming it.
#[tokio::test]
async fn ones_own_works_go_on_past_a_page_by_the_link_header_and_on_the_page() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "zuozhe", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 3)).await;
    let mut published = Vec::new();
    for (index, task) in tasks.iter().enumerate() {
        published.push(publish(app, &creator, task, &format!("第{index}幅"), true).await);
    }
    app.project().await;

    let mut seen = Vec::new();
    let mut path = "/api/v1/me/works?limit=2".to_owned();
    for _ in 0..3 {
        let response = app.get_as(&creator, &path).await;
        let link = response
            .headers()
            .get("link")
            .map(|value| value.to_str().unwrap().to_owned());
        let page = json_of(response).await;
        seen.extend(
            page.as_array()
                .unwrap()
                .iter()
                .map(|work| work["work_id"].as_str().unwrap().to_owned()),
        );
        match link {
            Some(link) => {
                assert!(link.ends_with(">; rel=\"next\""), "{link}");
                path = link[1..link.find('>').unwrap()].to_owned();
            }
            None => break,
        }
    }
    let mut expected = published.clone();
    expected.sort();
    expected.reverse();
    assert_eq!(seen, expected, "newest first, ties by id, each once");
    // Without a limit: the newest 200 at once, no link.
    let all = app.get_as(&creator, "/api/v1/me/works").await;
    assert!(all.headers().get("link").is_none());
    assert_eq!(json_of(all).await.as_array().unwrap().len(), 3);
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=201", "limit"),
        ("cursor=abc", "cursor"),
    ] {
        let refused = app
            .get_as(&creator, &format!("/api/v1/me/works?{query}"))
            .await;
        assert_eq!(refused.status(), 422, "{query}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(body["field"], field, "{body}");
    }

    // The page from the same cursor: only what is older, and a way back to the newest.
    let first = app.get_as(&creator, "/api/v1/me/works?limit=1").await;
    let link = first
        .headers()
        .get("link")
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let cursor = link
        .split("cursor=")
        .nth(1)
        .unwrap()
        .split('>')
        .next()
        .unwrap();
    // The cursor the server gives is one the API document allows, for this list and the tasks'
    // alike (a client checking against the document must not refuse it).
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let pattern_of = |path: &str| {
        let parameters = document["paths"][path]["get"]["parameters"]
            .as_array()
            .unwrap();
        let cursor = parameters.iter().find(|p| p["name"] == "cursor").unwrap();
        regex::Regex::new(cursor["schema"]["pattern"].as_str().unwrap()).unwrap()
    };
    assert!(pattern_of("/api/v1/me/works").is_match(cursor), "{cursor}");
    let tasks = json_of(app.get_as(&creator, "/api/v1/tasks?limit=1").await).await;
    let task_cursor = tasks["next_cursor"].as_str().unwrap();
    assert!(
        pattern_of("/api/v1/tasks").is_match(task_cursor),
        "{task_cursor}"
    );
    let page = page_text(app, &creator, &format!("/gallery/mine?cursor={cursor}")).await;
    let row = |work: &str| format!("href=\"/gallery/works/{work}\"");
    assert!(
        !page.contains(&row(&expected[0])),
        "the newest is on the page before: {page}"
    );
    assert!(page.contains(&row(&expected[1])) && page.contains(&row(&expected[2])));
    assert!(
        page.contains("href=\"/gallery/mine\""),
        "a link back to the newest"
    );
}

/// A creator with more followers than are pushed to is read at feed time; when followers leave
/// and they are pushed again, the works published meanwhile (never pushed) stay in a feed whose
/// inbox was live all along, on either process.
#[tokio::test]
async fn a_creator_pushed_again_after_being_pulled_keeps_their_works_in_a_live_feed() {
    let harness = gallery_harness(|settings| settings.gallery.push_followers_max = 2).await;
    let app = &harness.app;
    let second = app.another_instance().await;
    let (creator_id, creator) = funded_user(app, "huajia", "100").await;
    let follow = format!("/api/v1/gallery/creators/{creator_id}/follow");
    let mut followers = Vec::new();
    for name in ["duzhe", "guanzhong1", "guanzhong2"] {
        let (_, token) = member(app, name).await;
        let done = send(app, reqwest::Method::PUT, &follow, &token).await;
        assert!(done.status().is_success());
        followers.push(token);
    }
    let reader = &followers[0];
    // The reader's inbox is live before the work appears; three followers: the creator is pulled.
    assert!(ids(&json_of(app.get_as(reader, "/api/v1/gallery/feed").await).await).is_empty());
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    let work = publish(app, &creator, &tasks[0], "人多时发的作品", true).await;
    gallery_worker(app).catch_up().await.unwrap();
    let feed = json_of(app.get_as(reader, "/api/v1/gallery/feed").await).await;
    assert_eq!(ids(&feed), std::slice::from_ref(&work));

    // One follower leaves: two are left, the creator is pushed from now on.
    let left = send(&second, reqwest::Method::DELETE, &follow, &followers[2]).await;
    assert_eq!(json_of(left).await["following"], false);
    for process in [app, &second] {
        let feed = json_of(process.get_as(reader, "/api/v1/gallery/feed").await).await;
        assert_eq!(ids(&feed), std::slice::from_ref(&work), "{feed}");
    }
    // And what they publish next is pushed as before.
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    let next = publish(app, &creator, &tasks[0], "人少时发的作品", true).await;
    gallery_worker(app).catch_up().await.unwrap();
    let feed = json_of(second.get_as(&followers[1], "/api/v1/gallery/feed").await).await;
    // Both at one instant (the test clock stands still): equal times list by id, descending.
    let mut both = vec![next, work];
    both.sort();
    both.reverse();
    assert_eq!(ids(&feed), both, "{feed}");
}

/// The likes page of the web app pages like the other lists: 24 works, then a "more" link to
/// the next page, which lists the rest (the oldest like last).
#[tokio::test]
async fn the_likes_page_goes_on_past_its_first_page() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "duozuo", "100").await;
    let (_, fan) = member(app, "shoucang").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 25)).await;
    let mut works = Vec::new();
    for (index, task) in tasks.iter().enumerate() {
        let work = publish(app, &creator, task, &format!("第{index}幅"), true).await;
        let like = send(
            app,
            reqwest::Method::PUT,
            &format!("/api/v1/gallery/works/{work}/like"),
            &fan,
        )
        .await;
        assert!(like.status().is_success());
        app.clock.advance(Duration::from_secs(1));
        works.push(work);
    }
    app.project().await;
    let page = |path: String| {
        let fan = fan.clone();
        async move {
            let response = app
                .http
                .get(format!("{}{path}", app.address))
                .header("Accept", "text/html")
                .header("Cookie", format!("lang=zh; zhihui_session={fan}"))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{path}");
            response.text().await.unwrap()
        }
    };
    let listed = |html: &str| {
        works
            .iter()
            .filter(|work| html.contains(&format!("/gallery/works/{work}\"")))
            .count()
    };
    let first = page("/gallery/likes".into()).await;
    assert_eq!(listed(&first), 24);
    assert!(
        !first.contains(&format!("/gallery/works/{}\"", works[0])),
        "the oldest like waits"
    );
    let next = first
        .split("class=\"button more\" href=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a link to the next page")
        .replace("&#x2f;", "/")
        .replace("&amp;", "&");
    let second = page(next).await;
    assert_eq!(listed(&second), 1);
    assert!(second.contains(&format!("/gallery/works/{}\"", works[0])));
    assert!(!second.contains("class=\"button more\""));
}

/// A page form, as a browser in Chinese sends it: the session cookie, its CSRF token, our Origin.
pub(crate) async fn page_post(
    app: &TestApp,
    token: &str,
    path: &str,
    form: &[(&str, &str)],
) -> reqwest::Response {
    let mut body = url::form_urlencoded::Serializer::new(String::new());
    for (name, value) in form {
        body.append_pair(name, value);
    }
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{}{path}", app.address))
        .header("Origin", app.address.as_str())
        .header("Accept", "text/html")
        .header("Cookie", format!("lang=zh; zhihui_session={token}"))
        .header(
            zhihui::http::cookie::CSRF_HEADER,
            zhihui::http::cookie::csrf_token(token),
        )
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(body.finish())
        .send()
        .await
        .unwrap()
}

pub(crate) async fn page_text(app: &TestApp, token: &str, path: &str) -> String {
    let response = app
        .http
        .get(format!("{}{path}", app.address))
        .header("Accept", "text/html")
        .header("Cookie", format!("lang=zh; zhihui_session={token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{path}");
    response.text().await.unwrap()
}

fn location(response: &reqwest::Response) -> String {
    response.headers()["location"].to_str().unwrap().to_owned()
}

/// After publishing, unpublishing or hiding from the pages, the page a person lands on says it
/// was done, to them only; the list of one's works shows what the stream says of the work just
/// acted on, though its read model has not caught up (nothing projects in between here).
#[tokio::test]
async fn an_action_from_the_pages_is_confirmed_where_it_lands_even_before_the_read_models_catch_up()
{
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "huajia", "100").await;
    let admin = app.admin_token("guanliyuan").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 2)).await;
    app.project().await;

    let form = page_text(
        app,
        &creator,
        &format!("/gallery/publish?task={}", tasks[0]),
    )
    .await;
    let marker = "name=\"image\" value=\"";
    let start = form.find(marker).unwrap() + marker.len();
    let image = &form[start..start + 36];
    let published = page_post(
        app,
        &creator,
        "/gallery/publish",
        &[("task", &tasks[0]), ("title", "西湖晨雾"), ("image", image)],
    )
    .await;
    assert_eq!(
        published.status(),
        303,
        "{}",
        published.text().await.unwrap()
    );
    let to = location(&published);
    let work = to
        .strip_prefix("/gallery/works/")
        .and_then(|rest| rest.strip_suffix("?done=published"))
        .unwrap_or_else(|| panic!("published lands on {to}"))
        .to_owned();
    assert!(page_text(app, &creator, &to).await.contains("已发布到画廊"));
    // The address says "done", but only the creator is told.
    let (_, stranger) = member(app, "luren").await;
    assert!(
        !page_text(app, &stranger, &to)
            .await
            .contains("已发布到画廊")
    );
    let other = publish(app, &creator, &tasks[1], "断桥残雪", true).await;
    app.project().await;

    let unpublished = page_post(
        app,
        &creator,
        &format!("/gallery/works/{work}/unpublish"),
        &[],
    )
    .await;
    assert_eq!(unpublished.status(), 303);
    let to = location(&unpublished);
    assert_eq!(to, format!("/gallery/mine?done=unpublished&work={work}"));
    let mine = page_text(app, &creator, &to).await;
    assert!(mine.contains("作品已取消发布"), "{mine}");
    // The read model still says published; the row of the work just taken down does not.
    let row = |page: &str, title: &str| {
        let start = page.find(title).unwrap();
        page[start..start + page[start..].find("</tr>").unwrap()].to_owned()
    };
    assert!(row(&mine, "西湖晨雾").contains("已取消发布"), "{mine}");
    assert!(row(&mine, "断桥残雪").contains("已发布"), "{mine}");
    // Without the words in its address, the list says nothing of it.
    let plain = page_text(app, &creator, "/gallery/mine").await;
    assert!(!plain.contains("作品已取消发布"));
    // Taken down, it offers to be published again, with the form as it was published.
    assert!(
        row(&mine, "西湖晨雾").contains(&format!("/gallery/publish?task={}", tasks[0])),
        "{mine}"
    );
    let again = page_text(
        app,
        &creator,
        &format!("/gallery/publish?task={}", tasks[0]),
    )
    .await;
    assert!(again.contains(r#"value="西湖晨雾""#), "{again}");
    // Of the task's two images, the one published then is ticked, the other is not.
    assert!(
        again.contains(&format!(r#"value="{image}" checked><img"#)),
        "{again}"
    );
    assert_eq!(again.matches(r#"name="image""#).count(), 2, "{again}");
    assert_eq!(again.matches(" checked><img").count(), 1, "{again}");
    assert!(
        again.contains("已取消发布：下面按上次发布的内容填好了"),
        "{again}"
    );
    assert!(!form.contains(r#"value="西湖晨雾""#), "{form}");

    let reason = "画面含有未授权的商标";
    let hidden = page_post(
        app,
        &admin,
        &format!("/gallery/works/{other}/hide"),
        &[("reason", reason)],
    )
    .await;
    assert_eq!(hidden.status(), 303);
    let to = location(&hidden);
    assert_eq!(to, "/gallery?sort=new&done=hidden");
    assert!(page_text(app, &admin, &to).await.contains("作品已隐藏"));
    assert!(!page_text(app, &creator, &to).await.contains("作品已隐藏"));
    let mine = page_text(
        app,
        &creator,
        &format!("/gallery/mine?done=unpublished&work={other}"),
    )
    .await;
    assert!(row(&mine, "断桥残雪").contains(reason), "{mine}");
    // Its task's card no longer offers to publish it, and says where the reason is.
    app.project().await;
    let task = page_text(app, &creator, &format!("/tasks/{}", tasks[1])).await;
    assert!(
        task.contains(r#"<a class="button" href="/gallery/mine">作品已被隐藏：看原因</a>"#),
        "{task}"
    );
    assert!(
        !task.contains(&format!("/gallery/publish?task={}", tasks[1])),
        "{task}"
    );
    // Once the read models catch up, its task's card offers it again too, in those words.
    app.project().await;
    let history = page_text(app, &creator, "/history").await;
    let card = {
        let start = history.find(&format!(r#"id="task-{}""#, tasks[0])).unwrap();
        &history[start..start + history[start..].find("</article>").unwrap()]
    };
    assert!(
        card.contains(&format!(
            r#"<a class="button" href="/gallery/publish?task={}">重新发布</a>"#,
            tasks[0]
        )),
        "{card}"
    );
}

/// A rebuild of a cached card that was already reading when the work was hidden must not bring
/// the card back: not in Redis (another process would serve it for the value's lifetime), not
/// in this process's memory. Here the load itself "meets" the hide: it forgets the key (what a
/// hide does) before returning what it read, then a later read of either process loads again.
#[tokio::test]
async fn a_card_rebuilt_across_a_hide_is_not_kept_by_either_cache_level() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use zhihui::gallery::cache::Layered;

    let app = crate::helpers::spawn_app().await;
    let layer = |_: u8| {
        Layered::<String>::new(
            zhihui::platform::redis_store::RedisStore::new(&app.settings.redis).unwrap(),
            zhihui::platform::clock::Clock::System,
            Duration::from_secs(30),
            100,
        )
    };
    let (here, there) = (layer(0), layer(1));
    let key = format!(
        "{}:gallery-cache-race:{{w:1}}",
        app.settings.redis.key_prefix
    );
    let lock = format!("{key}:lock");
    let loads = Arc::new(AtomicU32::new(0));

    let racing = here.clone();
    let read = here
        .get(&key, &lock, || {
            let loads = loads.clone();
            let key = key.clone();
            async move {
                loads.fetch_add(1, Ordering::SeqCst);
                // The hide lands while this rebuild holds what it read before it.
                racing.forget(&key).await?;
                Ok(Some("公开的卡片".to_owned()))
            }
        })
        .await
        .unwrap();
    // The read that was concurrent with the hide may see the old card...
    assert_eq!(read.as_deref(), Some("公开的卡片"));
    // (A rebuild that begins in the tombstone's own millisecond is not kept either: it may have
    // begun after the hide. The reads below begin in a later one, as a later read would.)
    let mut connection = crate::helpers::redis_of(&app.settings).await;
    let tombstone: String = redis::AsyncCommands::get(&mut connection, &key)
        .await
        .unwrap();
    let forgotten_at = serde_json::from_str::<Value>(&tombstone).unwrap()["forgotten_at_ms"]
        .as_i64()
        .unwrap();
    loop {
        let (seconds, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut connection)
            .await
            .unwrap();
        if seconds * 1000 + micros / 1000 > forgotten_at {
            break;
        }
        tokio::task::yield_now().await;
    }
    // ...nobody after it does, in this process or another.
    for cache in [&here, &there] {
        let loads = loads.clone();
        let value = cache
            .get(&key, &lock, || async move {
                loads.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            })
            .await
            .unwrap();
        assert_eq!(*value, None, "a card from before the hide was served");
    }
    assert_eq!(
        loads.load(Ordering::SeqCst),
        2,
        "the hidden card is read again once"
    );
}

/// A page whose every work is filtered out for the reader (a creator they blocked published the
/// newest ones) does not read as the list's end: the read moves on to the works they may see,
/// in the feed and in the new list alike.
#[tokio::test]
async fn a_page_of_only_blocked_works_moves_on_to_the_works_the_reader_may_see() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, prolific) = funded_user(app, "gaochan", "100").await;
    let (_, quiet) = funded_user(app, "laoshi", "100").await;
    let (_, reader) = member(app, "duzhe").await;
    let quiet_id = follow_first(app, &quiet, &reader).await;
    let prolific_id = follow_first(app, &prolific, &reader).await;
    let quiet_tasks = Box::pin(succeeded_tasks(&harness, &quiet, 1)).await;
    let prolific_tasks = Box::pin(succeeded_tasks(&harness, &prolific, 3)).await;
    app.project().await;
    let kept = publish(app, &quiet, &quiet_tasks[0], "山水之间", true).await;
    // Each later than the one before: the blocked creator's are the newest.
    for (index, task) in prolific_tasks.iter().enumerate() {
        app.clock.advance(Duration::from_secs(1));
        publish(
            app,
            &prolific,
            task,
            &format!("连载第{}话", index + 1),
            true,
        )
        .await;
    }
    gallery_worker(app).catch_up().await.unwrap();
    app.project().await;
    let blocked = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/creators/{prolific_id}/block"),
        &reader,
    )
    .await;
    assert!(blocked.status().is_success(), "{}", blocked.status());
    for list in [
        "/api/v1/gallery/feed?limit=2",
        "/api/v1/gallery/new?limit=2",
    ] {
        let page = json_of(app.get_as(&reader, list).await).await;
        assert_eq!(ids(&page), std::slice::from_ref(&kept), "{list}: {page}");
    }
    assert_ne!(quiet_id, prolific_id);
}

/// With `labels.keep_comfy_metadata` on, the stored file keeps ComfyUI's workflow (its owner's
/// download has it); a published copy never does, so a prompt its creator hid stays hidden.
#[tokio::test]
async fn a_kept_comfyui_workflow_stays_in_the_owners_file_and_never_in_the_published_copy() {
    let harness = gallery_harness(|settings| settings.labels.keep_comfy_metadata = true).await;
    let app = &harness.app;
    let (_, token) = funded_user(app, "xiaolin", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &token, 1)).await;
    let work = publish(app, &token, &tasks[0], "江南烟雨", false).await;
    let text_keywords = |bytes: &[u8]| -> Vec<String> {
        png_chunks(bytes)
            .iter()
            .filter(|(kind, _)| matches!(kind.as_str(), "tEXt" | "iTXt" | "zTXt"))
            .map(|(_, data)| {
                String::from_utf8_lossy(data.split(|byte| *byte == 0).next().unwrap()).into_owned()
            })
            .collect()
    };
    // The owner's own file: the workflow is there (so the setting took effect).
    let view = json_of(
        app.get_as(&token, &format!("/api/v1/tasks/{}", tasks[0]))
            .await,
    )
    .await;
    let own = app
        .get_as(&token, view["images"][0]["url"].as_str().unwrap())
        .await
        .bytes()
        .await
        .unwrap();
    assert!(
        text_keywords(&own).contains(&"prompt".to_owned()),
        "{:?}",
        text_keywords(&own)
    );
    assert!(contains(&own, b"CLIPTextEncode"));
    // The published copy: the labels only, no prompt, and it still reads as labelled.
    let public = json_of(app.get(&format!("/api/v1/gallery/works/{work}")).await).await;
    for image in public["images"].as_array().unwrap() {
        let response = app.get(image.as_str().unwrap()).await;
        assert_eq!(response.status(), 200);
        let etag = response.headers()["etag"].to_str().unwrap().to_owned();
        let bytes = response.bytes().await.unwrap();
        assert_eq!(text_keywords(&bytes), ["AIGC", "XML:com.adobe.xmp"]);
        // ComfyUI writes its JSON with non-ASCII escaped: 江南 as \u6c5f\u5357.
        for needle in [
            PROMPT,
            NEGATIVE,
            "江南",
            "\\u6c5f\\u5357",
            "KSampler",
            "CLIPTextEncode",
        ] {
            assert!(
                !contains(&bytes, needle.as_bytes()),
                "{needle} inside the image"
            );
        }
        assert_eq!(
            zhihui::labels::metadata::read(&bytes)
                .unwrap()
                .png_text
                .unwrap()
                .label,
            "1"
        );
        assert!(
            image::load_from_memory(&bytes).is_ok(),
            "the copy is a whole image"
        );
        // Its own validator: a cache holding the owner's file never answers for it.
        assert!(etag.ends_with("-public\""), "{etag}");
    }
}

/// Sets `token`'s display name through `process`.
async fn rename(process: &TestApp, token: &str, name: impl serde::Serialize) -> reqwest::Response {
    process
        .put(
            "/api/v1/me/display-name",
            Some(token),
            &json!({ "display_name": name }),
        )
        .await
}

/// Waits (a second at most) until `process` answers `path` with `check` true.
pub(crate) async fn within_a_second(process: &TestApp, path: &str, check: impl Fn(&Value) -> bool) {
    let started = Instant::now();
    loop {
        let body = json_of(process.get(path).await).await;
        if check(&body) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{path} still answers {body} after a second"
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_chinese_display_name_names_its_user_on_every_work_and_process_at_once() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let second = app.another_instance().await;
    let (creator_id, creator) = funded_user(app, "xiaolin", "100").await;
    let (_, fan) = member(app, "fan_a").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    let work = publish(app, &creator, &tasks[0], "断桥残雪", true).await;
    let liked = send(
        app,
        reqwest::Method::PUT,
        &format!("/api/v1/gallery/works/{work}/like"),
        &fan,
    )
    .await;
    assert_eq!(json_of(liked).await["likes"], 1);
    let work_path = format!("/api/v1/gallery/works/{work}");
    let creator_path = format!("/api/v1/gallery/creators/{creator_id}");
    // Seen, so kept, by visitors of both processes.
    for process in [app, &second] {
        let view = json_of(process.get(&work_path).await).await;
        assert_eq!(view["creator_name"], "xiaolin");
        assert_eq!(view["first_likers"], json!(["fan_a"]));
        let new = json_of(process.get("/api/v1/gallery/new").await).await;
        assert_eq!(new["works"][0]["creator_name"], "xiaolin");
        let profile = json_of(process.get(&creator_path).await).await;
        assert_eq!(
            (&profile["name"], &profile["handle"]),
            (&json!("xiaolin"), &json!("xiaolin"))
        );
    }

    // The creator names themselves through one process, the fan through the other.
    let renamed = rename(app, &creator, "  西湖边的画室 ").await;
    let me = json_of(renamed).await;
    assert_eq!(me["display_name"], "西湖边的画室");
    assert_eq!(me["username"], "xiaolin");
    let renamed = rename(&second, &fan, "小粉丝🌸").await;
    assert_eq!(json_of(renamed).await["display_name"], "小粉丝🌸");
    for process in [&second, app] {
        within_a_second(process, &work_path, |view| {
            view["creator_name"] == "西湖边的画室" && view["first_likers"] == json!(["小粉丝🌸"])
        })
        .await;
        within_a_second(process, "/api/v1/gallery/new", |page| {
            page["works"][0]["creator_name"] == "西湖边的画室"
        })
        .await;
        within_a_second(process, &creator_path, |profile| {
            profile["name"] == "西湖边的画室" && profile["handle"] == "xiaolin"
        })
        .await;
    }

    // Refused, each naming its rule, and nothing changed.
    for (typed, rule) in [
        ("画师#1", "not_contain"),
        ("第一行\n第二行", "one_line"),
        (&*"画".repeat(21), "length_at_most"),
    ] {
        let refused = rename(app, &creator, typed).await;
        assert_eq!(refused.status(), 422, "{typed}");
        let body: Value = refused.json().await.unwrap();
        assert_eq!(
            (body["field"].as_str(), body["rule"].as_str()),
            (Some("display_name"), Some(rule)),
            "{body}"
        );
    }
    let me = json_of(app.get_as(&creator, "/api/v1/me").await).await;
    assert_eq!(me["display_name"], "西湖边的画室");

    // Empty takes the name away: the username again.
    let cleared = rename(app, &creator, "").await;
    assert!(json_of(cleared).await["display_name"].is_null());
    for process in [app, &second] {
        within_a_second(process, &work_path, |view| {
            view["creator_name"] == "xiaolin"
        })
        .await;
    }

    // Five changes a day: the sixth waits for the first to be a day old.
    for name in ["一", "二", "三"] {
        let answer = rename(app, &creator, name).await;
        assert_eq!(answer.status(), 200);
    }
    let refused = rename(&second, &creator, "第六次").await;
    assert_eq!(refused.status(), 429);
    let wait: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((86_390..=86_400).contains(&wait), "{wait}");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["type"], "/problems/renamed-too-often", "{body}");
    app.clock.advance(Duration::from_secs(86_400));
    // A day on, the session is over too.
    let creator = app.login("xiaolin", "correct horse battery").await;
    let answer = rename(&second, &creator, "第六次").await;
    assert_eq!(json_of(answer).await["display_name"], "第六次");

    app.project().await;
    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
}
