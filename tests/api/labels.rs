//! AI-generated labels (GB 45438-2025) end to end: a task's images, as every image route serves
//! them, carry the visible mark and the AIGC metadata (checked, its digest too); ComfyUI's own
//! text chunks are gone; the unlabelled original is for admins only; an image that cannot be
//! labelled fails its task and returns its points; `zhihui images inspect` tells ours apart.

#![allow(clippy::unwrap_used)]

use comfyui_sim::Faults;
use serde_json::Value;
use zhihui::labels::metadata::{self, AigcLabel};
use zhihui_domain::task::TaskStatus;

use crate::dispatch::{
    assert_settled, drive_until, drive_until_connected, drive_until_idle, failure_reason,
    harness_configured, submit_task,
};
use crate::tasks::funded_user;

/// The development key of `default_settings.toml`, which tests run with.
const KEY: &[u8] = zhihui::platform::configuration::DEVELOPMENT_LABEL_KEY.as_bytes();

/// Every path of the OpenAPI document whose GET answers an image.
async fn image_routes(app: &crate::helpers::TestApp) -> Vec<String> {
    let document: Value = app.get("/api/openapi.json").await.json().await.unwrap();
    let mut routes: Vec<String> = document["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, item)| {
            item["get"]["responses"]["200"]["content"]
                .as_object()
                .is_some_and(|content| content.keys().any(|kind| kind.starts_with("image/")))
        })
        .map(|(path, _)| path.clone())
        .collect();
    routes.sort();
    routes
}

#[tokio::test]
async fn every_image_route_serves_labelled_images_only_and_the_original_is_for_admins() {
    let harness = harness_configured(1, Faults::default(), |settings| {
        settings.labels.keep_original = true;
    })
    .await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "labelled", "10").await;
    let admin = app.admin_token("labels-admin").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 2, 2).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Succeeded],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let view: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{task}"))
        .await
        .json()
        .await
        .unwrap();
    let images: Vec<String> = view["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|image| {
            let url = image["url"].as_str().unwrap();
            url.rsplit('/').next().unwrap().to_owned()
        })
        .collect();
    assert_eq!(images.len(), 2, "{view}");

    // A new image route must be added here (and label what it serves) or this fails.
    assert_eq!(
        image_routes(app).await,
        [
            "/api/v1/admin/images/{id}/original",
            "/api/v1/gallery/works/{id}/images/{image}",
            "/api/v1/images/{id}"
        ]
    );
    // Published with its prompt hidden: the gallery's public route serves the same labelled
    // copy as the owner's route.
    let published: Value = app
        .post(
            "/api/v1/gallery/works",
            Some(&token),
            &serde_json::json!({"task_id": task, "title": "标识检查", "prompt_shown": false}),
        )
        .await
        .json()
        .await
        .unwrap();
    let work = published["work_id"].as_str().unwrap().to_owned();
    let inspect_dir = harness.directory.0.join("inspect");
    std::fs::create_dir_all(&inspect_dir).unwrap();
    for (index, image_id) in images.iter().enumerate() {
        // The user's route: both labels, ours, naming this task's image.
        let response = app
            .get_as(&token, &format!("/api/v1/images/{image_id}"))
            .await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-aigc-label"], "1");
        assert_eq!(response.headers()["content-type"], "image/png");
        let served = response.bytes().await.unwrap().to_vec();
        let public = app
            .get(&format!("/api/v1/gallery/works/{work}/images/{image_id}"))
            .await;
        assert_eq!(public.status(), 200);
        assert_eq!(public.headers()["x-aigc-label"], "1");
        assert_eq!(public.bytes().await.unwrap().to_vec(), served);
        let found = metadata::read(&served).unwrap();
        let text: AigcLabel = found.png_text.clone().expect("the AIGC tEXt chunk");
        assert_eq!(text.label, "1");
        assert_eq!(text.content_producer, "zhihui");
        assert_eq!(text.produce_id, format!("{task}-{index}"));
        assert_eq!(
            (
                text.content_propagator.as_str(),
                text.propagate_id.as_str(),
                text.reserved_code2.as_str()
            ),
            ("", "", "")
        );
        assert!(text.verify(KEY), "ReservedCode1 does not check out");
        assert_eq!(found.xmp.as_ref(), Some(&text), "the XMP says the same");
        // ComfyUI's graph (`prompt`) is not handed out.
        assert!(found.other_text_keywords.is_empty(), "{found:?}");

        // The admin's route: the original, as the server wrote it, no label, the graph kept.
        let refused = app
            .get_as(&token, &format!("/api/v1/admin/images/{image_id}/original"))
            .await;
        assert_eq!(refused.status(), 403);
        let original = app
            .get_as(&admin, &format!("/api/v1/admin/images/{image_id}/original"))
            .await;
        assert_eq!(original.status(), 200);
        let original = original.bytes().await.unwrap().to_vec();
        let raw = metadata::read(&original).unwrap();
        assert!(raw.png_text.is_none() && raw.xmp.is_none());
        assert!(raw.other_text_keywords.contains(&"prompt".to_owned()));

        // The visible mark: the pixels that differ from the original lie in the bottom-right
        // corner, and are at least 5 % of the shorter side high.
        let before = image::load_from_memory(&original).unwrap().into_rgb8();
        let after = image::load_from_memory(&served).unwrap().into_rgb8();
        assert_eq!(before.dimensions(), after.dimensions());
        let (width, height) = after.dimensions();
        let (mut top, mut bottom, mut left) = (u32::MAX, 0, u32::MAX);
        for (x, y, pixel) in after.enumerate_pixels() {
            if pixel != before.get_pixel(x, y) {
                top = top.min(y);
                bottom = bottom.max(y);
                left = left.min(x);
            }
        }
        assert!(bottom >= top, "no visible mark");
        assert!(
            left > width / 2 && top > height / 2,
            "mark outside its corner"
        );
        assert!(f64::from(bottom - top + 1) >= 0.05 * f64::from(width.min(height)));

        // `zhihui images inspect`: ours checks out, by file and by id; the original does not.
        let labelled_file = inspect_dir.join(format!("{index}.png"));
        std::fs::write(&labelled_file, &served).unwrap();
        let raw_file = inspect_dir.join(format!("{index}-original.png"));
        std::fs::write(&raw_file, &original).unwrap();
        let images_directory = harness.directory.0.join("images");
        let inspect = |target: &str| {
            std::process::Command::new(env!("CARGO_BIN_EXE_zhihui"))
                .args(["images", "inspect", target])
                .env("ZHIHUI_DISPATCH__IMAGES_DIRECTORY", &images_directory)
                .env("ZHIHUI_LOG__FILTER", "warn")
                .output()
                .unwrap()
        };
        for target in [labelled_file.to_str().unwrap(), image_id.as_str()] {
            let output = inspect(target);
            let printed = String::from_utf8_lossy(&output.stdout);
            assert!(output.status.success(), "{printed}");
            assert!(printed.contains("PNG tEXt AIGC: ReservedCode1 checks out"));
            assert!(printed.contains("XMP TC260:AIGC: ReservedCode1 checks out"));
            assert!(printed.contains(&format!("{task}-{index}")));
        }
        let output = inspect(raw_file.to_str().unwrap());
        assert!(!output.status.success());
        assert!(String::from_utf8_lossy(&output.stdout).contains("absent"));
    }
    assert_settled(&harness, &process, &user, 8).await;
    saga.resign().await;
}

#[tokio::test]
async fn an_image_that_cannot_be_labelled_fails_its_task_and_returns_its_points() {
    let faults = Faults {
        corrupt_images: true,
        ..Faults::default()
    };
    let harness = harness_configured(1, faults, |_| {}).await;
    let app = &harness.app;
    let (user, token) = funded_user(app, "damaged", "10").await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;
    let task = submit_task(app, &token, 1, 2).await;
    drive_until(
        &mut saga,
        &process,
        std::slice::from_ref(&task),
        &[TaskStatus::Failed],
    )
    .await;
    drive_until_idle(&mut saga).await;
    let reason = failure_reason(app, &task).await;
    assert_eq!(
        reason,
        "the image server returned an image that cannot be read"
    );
    let view: Value = app
        .get_as(&token, &format!("/api/v1/tasks/{task}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(view["images"].as_array().map_or(0, Vec::len), 0, "{view}");
    // Nothing was stored: no unlabelled file under the image store.
    let blobs = harness.directory.0.join("images").join("blobs");
    assert!(!blobs.exists(), "an image was stored");
    assert_settled(&harness, &process, &user, 10).await;
    saga.resign().await;
}
