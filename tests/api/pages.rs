//! The web app's answers to what goes wrong, as a person in a browser meets them: a missing
//! page, a store that is away, the language switch. Each in the reader's language (Chinese
//! first), with the site's navigation; programs keep getting problem+json.

#![allow(clippy::unwrap_used)]

use crate::helpers::{dead_port, one_redis_at, spawn_app, spawn_app_with};

const BROWSER_ACCEPT: &str = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8";

fn browser() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

async fn page(
    client: &reqwest::Client,
    url: &str,
    language: &str,
) -> (u16, reqwest::header::HeaderMap, String) {
    let response = client
        .get(url)
        .header("Accept", BROWSER_ACCEPT)
        .header("Accept-Language", language)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

fn content_type(headers: &reqwest::header::HeaderMap) -> &str {
    headers
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_missing_page_is_said_in_the_readers_language_with_the_navigation_and_programs_get_problem_json()
 {
    let app = spawn_app().await;
    let client = browser();
    let url = format!("{}/画廊/不存在", app.address);

    let (status, headers, body) = page(&client, &url, "zh-CN,zh;q=0.9").await;
    assert_eq!(status, 404);
    assert!(
        content_type(&headers).starts_with("text/html"),
        "{headers:?}"
    );
    assert!(body.contains(r#"<html lang="zh-CN""#), "{body}");
    assert!(body.contains("找不到这个页面或内容。"), "{body}");
    assert!(body.contains(r#"href="/gallery""#), "the way back: {body}");
    assert!(
        body.contains(r#"name="viewport""#),
        "laid out for a phone: {body}"
    );
    assert!(!body.contains("/problems/"), "{body}");

    let (status, _, body) = page(&client, &url, "en-US,en;q=0.9").await;
    assert_eq!(status, 404);
    assert!(body.contains("There is no such page or item."), "{body}");
    assert!(!body.contains("找不到"), "{body}");

    // A program asking for the same address, or a browser asking the API: problem+json.
    let response = client
        .get(&url)
        .header("Accept", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(content_type(response.headers()), "application/problem+json");
    let api = format!("{}/api/v1/nothing-here", app.address);
    let (status, headers, _) = page(&client, &api, "zh-CN").await;
    assert_eq!(status, 404);
    assert_eq!(content_type(&headers), "application/problem+json");
    // An API path under a method it does not take keeps its 405 and `Allow`.
    let response = client
        .delete(format!("{}/api/v1/me", app.address))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert!(response.headers().contains_key("allow"));
}

#[tokio::test]
async fn a_page_while_redis_is_away_is_a_503_to_retry_said_in_the_readers_language() {
    let app = spawn_app_with(|settings| {
        one_redis_at(settings, format!("redis://127.0.0.1:{}/0", dead_port()));
    })
    .await;
    let client = browser();
    for (language, said, not_said) in [
        (
            "zh-CN,zh;q=0.9",
            "服务暂时不可用，请稍后再试。",
            "unavailable for a moment",
        ),
        (
            "en-US,en;q=0.9",
            "The service is unavailable for a moment",
            "服务暂时不可用",
        ),
    ] {
        let (status, headers, body) =
            page(&client, &format!("{}/gallery", app.address), language).await;
        assert_eq!(status, 503, "a store away is never a 500: {body}");
        assert_eq!(
            headers.get("retry-after").and_then(|v| v.to_str().ok()),
            Some("2")
        );
        assert!(content_type(&headers).starts_with("text/html"));
        assert!(body.contains(said), "{body}");
        assert!(!body.contains(not_said), "{body}");
        assert!(body.contains(r#"href="/gallery""#), "{body}");
    }
}

#[tokio::test]
async fn the_language_changes_only_by_a_post_from_our_own_pages() {
    let app = spawn_app().await;
    let client = browser();
    let switch = format!("{}/lang/en?next=%2Fgallery", app.address);

    // A GET (a cross-site image, a prefetch) changes nothing.
    let response = client
        .get(&switch)
        .header("Accept", BROWSER_ACCEPT)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert!(response.headers().get("set-cookie").is_none());

    // A form on another site is refused.
    let response = client
        .post(&switch)
        .header("Origin", "https://elsewhere.example")
        .header("Accept", BROWSER_ACCEPT)
        .header("Accept-Language", "zh-CN")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 403);
    assert!(response.headers().get("set-cookie").is_none());
    assert!(
        response
            .text()
            .await
            .unwrap()
            .contains("拒绝来自其他网站的请求。")
    );

    // Our own page's form: the cookie is set and the reader goes back where they were.
    let response = client
        .post(&switch)
        .header("Origin", app.address.as_str())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 303);
    assert_eq!(
        response
            .headers()
            .get("location")
            .unwrap()
            .to_str()
            .unwrap(),
        "/gallery"
    );
    let cookie = response
        .headers()
        .get("set-cookie")
        .unwrap()
        .to_str()
        .unwrap();
    assert!(cookie.starts_with("lang=en"), "{cookie}");
    let (_, _, body) = page(&client, &format!("{}/gallery", app.address), "zh-CN").await;
    assert!(
        body.contains(r#"action="/lang/en?next="#),
        "the switch is a form: {body}"
    );
}

#[tokio::test]
async fn a_form_sent_after_the_session_ended_returns_to_its_own_page_after_signing_in() {
    let app = spawn_app().await;
    let client = browser();
    let send = |referer: String| {
        client
            .post(format!("{}/checkin", app.address))
            .header("Origin", app.address.as_str())
            .header("Referer", referer)
            .header("Cookie", "zhihui_session=ended-long-ago")
            .send()
    };
    let location = |response: &reqwest::Response| {
        response
            .headers()
            .get("location")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let response = send(format!("{}/history?status=failed", app.address))
        .await
        .unwrap();
    assert_eq!(response.status(), 303);
    assert_eq!(
        location(&response).as_deref(),
        Some("/login?next=/history%3Fstatus%3Dfailed")
    );
    // A page of another site is never where anyone is sent back to.
    let response = send("https://elsewhere.example/history".into())
        .await
        .unwrap();
    assert_eq!(
        location(&response).as_deref(),
        Some("/login?next=/generate")
    );
}
