//! The web app's answers to what goes wrong, as a person in a browser meets them: a missing
//! page, a store that is away, the language switch. Each in the reader's language (Chinese
//! first), with the site's navigation; programs keep getting problem+json.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

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
    // A form the page shows again for the same reason says when to try again too, and keeps
    // what was typed.
    for path in ["/login", "/register"] {
        let response = client
            .post(format!("{}{path}", app.address))
            .header("Origin", app.address.as_str())
            .header("Accept", BROWSER_ACCEPT)
            .header("Accept-Language", "zh-CN")
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body("method=password&username=xiaohong&password=correct+horse")
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let body = response.text().await.unwrap();
        assert_eq!(status, 503, "{path}: {body}");
        assert_eq!(retry_after.as_deref(), Some("2"), "{path}");
        assert!(body.contains("服务暂时不可用"), "{path}: {body}");
        assert!(body.contains("xiaohong"), "{path}: {body}");
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

/// The catalogs as the pages use them (`section.key -> text`).
fn catalog(lang: &str) -> std::collections::BTreeMap<String, String> {
    let source = match lang {
        "zh" => include_str!("../../src/web/i18n/zh.toml"),
        _ => include_str!("../../src/web/i18n/en.toml"),
    };
    let table: toml::Table = source.parse().unwrap();
    let mut out = std::collections::BTreeMap::new();
    for (section, entries) in table {
        if let toml::Value::Table(entries) = entries {
            for (key, text) in entries {
                if let toml::Value::String(text) = text {
                    out.insert(format!("{section}.{key}"), text);
                }
            }
        }
    }
    out
}

/// The words of every rule's sentence in `lang` that name no value: any of them in a page of the
/// other language is a field error said in the wrong language.
fn rule_words(lang: &str) -> Vec<String> {
    catalog(lang)
        .into_iter()
        .filter(|(key, _)| key.starts_with("rule."))
        .flat_map(|(_, text)| {
            text.split(['{', '}'])
                .step_by(2)
                .map(str::trim)
                .filter(|words| words.chars().count() >= 6)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A page's form sent with what a person might type: `(what, path, session, body)`, and what the
/// page must say: `(field, rule, the rule's values)`.
type Case<'a> = (
    &'a str,
    String,
    Option<&'a str>,
    String,
    (&'a str, &'a str, Vec<(&'a str, &'a str)>),
);

/// `field` broke `rule` (its `{name}`s from `args`), as a page in `lang` says it.
fn said(lang: &str, field: &str, rule: &str, args: &[(&str, &str)]) -> String {
    let catalog = catalog(lang);
    let mut sentence = catalog[&format!("rule.{rule}")].clone();
    for (name, value) in args {
        sentence = sentence.replace(&format!("{{{name}}}"), value);
    }
    catalog["error.field"]
        .replace("{field}", &catalog[&format!("field.{field}")])
        .replace("{message}", &sentence)
}

#[tokio::test]
async fn a_field_error_in_a_page_is_said_in_the_pages_language_never_the_apis_english() {
    let app = spawn_app().await;
    let client = browser();
    let admin = app.admin_token("guanliyuan").await;
    let member_id = app.register("xiaohong", "correct horse").await;
    let member = app.login("xiaohong", "correct horse").await;
    let steps_min = app.settings.tasks.steps_min.to_string();
    let steps_max = app.settings.tasks.steps_max.to_string();
    let form = |pairs: &[(&str, &str)]| {
        let mut body = url::form_urlencoded::Serializer::new(String::new());
        for (name, value) in pairs {
            body.append_pair(name, value);
        }
        body.finish()
    };
    // Each: a page's form, what a person might type, what the page must say.
    let cases: Vec<Case> = vec![
        (
            "a username that breaks a rule",
            "/register".into(),
            None,
            form(&[("username", "9lives"), ("password", "correct horse")]),
            ("username", "username_starts_with_letter", vec![]),
        ),
        (
            "a phone number without a country code",
            "/login/code".into(),
            None,
            form(&[("phone", "2025550123")]),
            ("phone", "phone_country_code", vec![]),
        ),
        (
            "a prompt of only spaces",
            "/generate".into(),
            Some(member.as_str()),
            form(&[("prompt", "   ")]),
            ("prompt", "not_empty", vec![]),
        ),
        (
            "steps out of range",
            "/generate".into(),
            Some(member.as_str()),
            form(&[("prompt", "雪中的红狐狸"), ("steps", "500")]),
            (
                "steps",
                "integer_between",
                vec![("min", &steps_min), ("max", &steps_max), ("value", "500")],
            ),
        ),
        (
            "a work published with every picture unticked",
            "/gallery/publish".into(),
            Some(member.as_str()),
            form(&[
                ("task", &uuid::Uuid::now_v7().to_string()),
                ("title", "雪中的红狐狸"),
            ]),
            ("work_images", "work_no_images", vec![]),
        ),
        (
            "a grant too large",
            format!("/admin/users/{member_id}/grant"),
            Some(admin.as_str()),
            form(&[("amount", "2000000000"), ("reason", "活动奖励")]),
            ("amount", "at_most", vec![("max", "1000000000")]),
        ),
    ];
    for lang in ["zh", "en"] {
        let other = if lang == "zh" { "en" } else { "zh" };
        let foreign = rule_words(other);
        for (what, path, token, body, (field, rule, args)) in &cases {
            let mut request = client
                .post(format!("{}{path}", app.address))
                .header("Origin", app.address.as_str())
                .header("Accept", BROWSER_ACCEPT)
                .header("Cookie", format!("lang={lang}"))
                .header("Content-Type", "application/x-www-form-urlencoded")
                .header("HX-Request", "true");
            if let Some(token) = token {
                request = request
                    .header("Cookie", format!("lang={lang}; zhihui_session={token}"))
                    .header(
                        zhihui::http::cookie::CSRF_HEADER,
                        zhihui::http::cookie::csrf_token(token),
                    );
            }
            let response = request.body(body.clone()).send().await.unwrap();
            let status = response.status().as_u16();
            let page = response.text().await.unwrap();
            let expected = said(lang, field, rule, args);
            assert!(
                page.contains(&expected),
                "{what} ({lang}, {status}): the page should say {expected:?}: {page}"
            );
            for words in &foreign {
                assert!(
                    !page.contains(words.as_str()),
                    "{what} ({lang}): {words:?} is the other language's: {page}"
                );
            }
        }
    }
}

/// One clock: a page draws its times in the zone the reader's browser told (the `tz` cookie,
/// minutes east of UTC, which the page's script sets), and before it has told one, in the
/// platform's zone with that zone named; the page tells its script which zone it drew in, so
/// the live estimates beside them read the same.
#[tokio::test]
async fn a_page_draws_its_times_in_the_readers_zone_or_names_the_zone_it_used() {
    let app = spawn_app().await;
    let (_, token) = crate::tasks::funded_user(&app, "xiaozhou", "10").await;
    let response = crate::tasks::submit(
        &app,
        &token,
        &serde_json::json!({"prompt": "黄昏的长城"}),
        None,
    )
    .await;
    assert_eq!(response.status(), 201);
    let task: serde_json::Value = response.json().await.unwrap();
    let task_id = task["task_id"].as_str().unwrap().to_owned();
    app.project().await;
    let submitted_at = app
        .get_as(&token, &format!("/api/v1/tasks/{task_id}"))
        .await
        .json::<serde_json::Value>()
        .await
        .unwrap()["submitted_at"]
        .as_str()
        .unwrap()
        .parse::<chrono::DateTime<chrono::Utc>>()
        .unwrap();
    let history = |cookie: String| {
        let url = format!("{}/history", app.address);
        async move {
            browser()
                .get(url)
                .header("Cookie", cookie)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    let when = |page: &str| {
        let start = page.find(r#"<span class="when">"#).unwrap() + r#"<span class="when">"#.len();
        page[start..start + page[start..].find("</span>").unwrap()].to_owned()
    };
    let in_zone = |minutes: i32| {
        submitted_at
            .with_timezone(&chrono::FixedOffset::east_opt(minutes * 60).unwrap())
            .format("%Y-%m-%d %H:%M")
            .to_string()
    };
    let platform = app.settings.auth.day_utc_offset_minutes;

    // The browser has not told its zone yet: the platform's, named.
    let page = history(format!("lang=zh; zhihui_session={token}")).await;
    let label = if platform % 60 == 0 {
        format!("UTC{:+}", platform / 60)
    } else {
        format!("UTC{:+}:{:02}", platform / 60, (platform % 60).abs())
    };
    assert_eq!(when(&page), format!("{} ({label})", in_zone(platform)));
    assert!(
        page.contains(&format!(r#"data-tz-offset="{platform}""#)),
        "{page}"
    );
    assert!(
        page.contains(&format!(r#"data-tz-label="{label}""#)),
        "{page}"
    );

    // New York in winter (UTC-5), told by the browser: its own time, no zone to misread.
    let page = history(format!("lang=en; zhihui_session={token}; tz=-300")).await;
    assert_eq!(when(&page), in_zone(-300));
    assert!(page.contains(r#"data-tz-offset="-300""#), "{page}");
    assert!(!page.contains("data-tz-label"), "{page}");

    // A zone no place has (past UTC+14) is not believed.
    let page = history(format!("lang=zh; zhihui_session={token}; tz=9999")).await;
    assert!(when(&page).ends_with(&format!("({label})")));
}

/// A form's local times are the reader's, as every other time on the page: an admin in New York
/// is offered now in New York, and 09:00 typed there is 14:00 UTC.
#[tokio::test]
async fn a_forms_local_times_are_read_in_the_readers_zone() {
    let app = spawn_app().await;
    let admin = app.admin_token("guanli").await;
    let cookie = format!("lang=zh; zhihui_session={admin}; tz=-300");
    let form = browser()
        .get(format!("{}/admin/codes", app.address))
        .header("Cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value_of = |id: &str| {
        let start = form.find(&format!(r#"id="{id}""#)).unwrap();
        let value = &form[start..];
        let value = &value[value.find(r#"value=""#).unwrap() + 7..];
        value[..value.find('"').unwrap()].to_owned()
    };
    let offered =
        chrono::NaiveDateTime::parse_from_str(&value_of("valid_from"), "%Y-%m-%dT%H:%M").unwrap();
    let new_york_now = app
        .clock
        .now()
        .with_timezone(&chrono::FixedOffset::west_opt(5 * 3600).unwrap())
        .naive_local();
    assert_eq!(
        offered.format("%Y-%m-%dT%H:%M").to_string(),
        new_york_now.format("%Y-%m-%dT%H:%M").to_string()
    );

    let mut body = url::form_urlencoded::Serializer::new(String::new());
    for (name, value) in [
        ("count", "1"),
        ("points", "5"),
        ("valid_from", "2027-02-10T09:00"),
        ("valid_until", "2027-02-11T09:00"),
        ("note", "纽约的兑换码"),
    ] {
        body.append_pair(name, value);
    }
    let created = browser()
        .post(format!("{}/admin/codes", app.address))
        .header("Origin", app.address.as_str())
        .header("Accept", "text/html")
        .header("Cookie", &cookie)
        .header(
            zhihui::http::cookie::CSRF_HEADER,
            zhihui::http::cookie::csrf_token(&admin),
        )
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body(body.finish())
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 200);
    let fragment = created.text().await.unwrap();
    let start = fragment.find(r#"id="batch-"#).expect(&fragment) + r#"id="batch-"#.len();
    let batch_id = &fragment[start..start + 36];
    let batch: serde_json::Value = app
        .get_as(&admin, &format!("/api/v1/admin/code-batches/{batch_id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(batch["valid_from"], "2027-02-10T14:00:00Z", "{batch}");
    assert_eq!(batch["valid_until"], "2027-02-11T14:00:00Z", "{batch}");
}

/// A page's whole address survives signing in (a visitor's "make one like this" carries the
/// work, a publish its task); an address a page cannot read (its task missing, a filter given
/// twice) is a page in the reader's language, never the API's JSON.
#[tokio::test]
async fn a_pages_query_survives_signing_in_and_one_it_cannot_read_is_a_page_not_json() {
    let app = spawn_app().await;
    let client = browser();
    let task = uuid::Uuid::now_v7();
    let (status, headers, _) = page(
        &client,
        &format!("{}/gallery/publish?task={task}", app.address),
        "zh-CN",
    )
    .await;
    assert_eq!(status, 303);
    assert_eq!(
        headers["location"].to_str().unwrap(),
        format!("/login?next=/gallery/publish%3Ftask%3D{task}")
    );

    app.register("xiaohong", "a long enough password").await;
    let token = app.login("xiaohong", "a long enough password").await;
    for (lang, expected) in [
        ("zh", "这个地址里的参数不对或不完整"),
        ("en", "This address has a missing or wrong parameter"),
    ] {
        for path in [
            "/gallery/publish",
            "/history?status=failed&status=succeeded",
        ] {
            let response = client
                .get(format!("{}{path}", app.address))
                .header("Accept", BROWSER_ACCEPT)
                .header("Cookie", format!("lang={lang}; zhihui_session={token}"))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let headers = response.headers().clone();
            let body = response.text().await.unwrap();
            assert!((400..500).contains(&status), "{path}: {status}");
            assert!(
                content_type(&headers).starts_with("text/html"),
                "{path}: {headers:?}"
            );
            assert!(body.contains(expected), "{path} ({lang}): {body}");
        }
    }
    // The API's own answer to the same mistake stays problem+json.
    let api = app.get_as(&token, "/api/v1/gallery/hot?limit=many").await;
    assert_eq!(api.status(), 422);
    assert_eq!(content_type(api.headers()), "application/problem+json");
}

#[tokio::test]
async fn a_model_reads_as_its_name_on_the_pages_while_requests_keep_its_file_name() {
    let configured = "majicmixRealistic_v7.safetensors";
    let unnamed = "anythingelseV4_v45.safetensors";
    let app = spawn_app_with(|settings| {
        settings.tasks.models = vec![configured.into(), unnamed.into()];
        settings.tasks.model_names =
            std::iter::once((configured.to_owned(), "麦橘写实 v7".to_owned())).collect();
    })
    .await;
    let client = browser();
    let admin = app.admin_token("guanliyuan").await;
    let member_id = app.register("xiaohong", "correct horse").await;
    let member = app.login("xiaohong", "correct horse").await;
    let granted = app
        .post(
            &format!("/api/v1/admin/accounts/{member_id}/grants"),
            Some(&admin),
            &serde_json::json!({"amount": "5", "reason": "试用"}),
        )
        .await;
    assert_eq!(granted.status().as_u16(), 201);
    let submitted = app
        .post(
            "/api/v1/tasks",
            Some(&member),
            &serde_json::json!({"prompt": "雪中的红狐狸", "model": unnamed}),
        )
        .await;
    assert_eq!(
        submitted.status().as_u16(),
        201,
        "{}",
        submitted.text().await.unwrap()
    );

    let get = |path: &str| {
        client
            .get(format!("{}{path}", app.address))
            .header("Accept", BROWSER_ACCEPT)
            .header("Cookie", format!("lang=zh; zhihui_session={member}"))
            .send()
    };
    let form = get("/generate").await.unwrap().text().await.unwrap();
    // The choice sends the file name and shows the name.
    assert!(
        form.contains(&format!(
            "<option value=\"{configured}\">麦橘写实 v7</option>"
        )) || form.contains(&format!(
            "<option value=\"{configured}\" selected>麦橘写实 v7</option>"
        )),
        "{form}"
    );
    assert!(form.contains(">anythingelseV4 v45</option>"), "{form}");
    app.project().await;
    let history = get("/history").await.unwrap().text().await.unwrap();
    assert!(history.contains("anythingelseV4 v45 ·"), "{history}");
    assert!(!history.contains(".safetensors"), "{history}");
}

/// A form that cannot be read (a field missing, as an out-of-date page would send, or too
/// large) is a page in the reader's language naming what to do, never actix's plain-text 400.
#[tokio::test]
async fn a_form_that_cannot_be_read_is_a_page_in_the_readers_language() {
    let app = spawn_app().await;
    let client = browser();
    let post = |body: String, lang: &'static str| {
        client
            .post(format!("{}/login", app.address))
            .header("Origin", app.address.as_str())
            .header("Accept", BROWSER_ACCEPT)
            .header("Cookie", format!("lang={lang}"))
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
    };
    for (lang, expected) in [
        ("zh", "这份表单缺少内容或内容有误"),
        ("en", "This form arrived incomplete or garbled"),
    ] {
        let response = post("username=xiaohong&password=x".into(), lang)
            .await
            .unwrap();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.text().await.unwrap();
        assert_eq!(status, 422, "{body}");
        assert!(
            content_type(&headers).starts_with("text/html"),
            "{headers:?}"
        );
        assert!(body.contains(expected), "{lang}: {body}");
        assert!(!body.contains("Parse error"), "{body}");
    }
    let limit = zhihui::web::form_body_bytes_max(&app.settings.tasks);
    let response = post(
        format!("method=password&username={}", "长".repeat(limit)),
        "zh",
    )
    .await
    .unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("提交的内容太长"), "{body}");
}

/// A signed-in reader's form, sent as htmx sends it: the session cookie (Chinese pages), the
/// CSRF header, from the site itself.
pub(crate) async fn htmx_form(
    client: &reqwest::Client,
    base: &str,
    token: &str,
    path: &str,
    body: &str,
) -> reqwest::Response {
    client
        .post(format!("{base}{path}"))
        .header("Origin", base)
        .header("Accept", BROWSER_ACCEPT)
        .header("Cookie", format!("lang=zh; zhihui_session={token}"))
        .header("Content-Type", "application/x-www-form-urlencoded")
        .header("HX-Request", "true")
        .header(
            zhihui::http::cookie::CSRF_HEADER,
            zhihui::http::cookie::csrf_token(token),
        )
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

/// A signed-in reader's page, in Chinese.
async fn page_of(client: &reqwest::Client, base: &str, token: &str, path: &str) -> String {
    client
        .get(format!("{base}{path}"))
        .header("Accept", BROWSER_ACCEPT)
        .header("Cookie", format!("lang=zh; zhihui_session={token}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// An admin's own user page offers no role form and says why; the form posted anyway is refused
/// in the reader's words, and the role stays.
#[tokio::test]
async fn an_admins_own_page_does_not_offer_to_change_their_role() {
    let app = spawn_app().await;
    let (client, base) = (browser(), app.address.as_str());
    let admin = app.admin_token("guanliyuan").await;
    let me: serde_json::Value = app.get_as(&admin, "/api/v1/me").await.json().await.unwrap();
    let own = format!("/admin/users/{}", me["id"].as_str().unwrap());
    let other = app.register("xiaohong", "correct horse").await;
    let body = page_of(&client, base, &admin, &own).await;
    assert!(body.contains("管理员不能修改自己的角色"), "{body}");
    assert!(!body.contains(r#"name="role""#), "{body}");
    let body = page_of(&client, base, &admin, &format!("/admin/users/{other}")).await;
    assert!(body.contains(r#"name="role""#), "{body}");

    let refused = htmx_form(&client, base, &admin, &format!("{own}/role"), "role=user").await;
    let refused = refused.text().await.unwrap();
    assert!(
        refused.contains("管理员不能修改自己的角色，请另一位管理员操作。"),
        "{refused}"
    );
    let still: serde_json::Value = app.get_as(&admin, "/api/v1/me").await.json().await.unwrap();
    assert_eq!(still["role"], "admin");
}

/// A visitor sent to log in from a work may sign up instead: the header's sign-up link on the
/// login page goes on to the work, and so does the registration.
#[tokio::test]
async fn signing_up_from_the_login_page_goes_on_to_where_the_login_was_going() {
    let app = spawn_app().await;
    let client = browser();
    let work = "/gallery/works/0192b8f0-0000-7000-8000-000000000001";
    let (status, _, body) = page(
        &client,
        &format!("{}/login?next={work}", app.address),
        "zh-CN",
    )
    .await;
    assert_eq!(status, 200);
    // (The template escapes a slash in an attribute.)
    let escaped = |path: &str| path.replace('/', "&#x2f;");
    assert!(
        body.contains(&format!(r#"href="/register?next={}""#, escaped(work))),
        "{body}"
    );
    // Elsewhere, the header's links come back to the page they were on.
    let (_, _, body) = page(
        &client,
        &format!("{}/gallery?tab=new", app.address),
        "zh-CN",
    )
    .await;
    assert!(
        body.contains(&format!(
            r#"href="/register?next={}""#,
            escaped("/gallery%3Ftab%3Dnew")
        )),
        "{body}"
    );

    let registered = client
        .post(format!("{}/register?next={work}", app.address))
        .header("Origin", app.address.as_str())
        .header("Accept", BROWSER_ACCEPT)
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("username=xinlai&password=correct+horse")
        .send()
        .await
        .unwrap();
    assert_eq!(registered.status(), 303, "{:?}", registered.text().await);
    assert_eq!(
        registered
            .headers()
            .get("location")
            .unwrap()
            .to_str()
            .unwrap(),
        work
    );
}

/// The settings page: a key made there is shown once and works within its scopes; a key's
/// scopes must be chosen; revoked there, it is refused; the admin scope is not a user's to
/// take; a password changed there ends the session and the new one logs in.
#[tokio::test]
async fn a_user_makes_uses_and_revokes_a_key_and_changes_the_password_on_the_settings_page() {
    let app = spawn_app().await;
    let (client, base) = (browser(), app.address.as_str());
    app.register("xiaohong", "correct horse").await;
    let token = app.login("xiaohong", "correct horse").await;
    let body = page_of(&client, base, &token, "/settings").await;
    assert!(
        body.contains("账号设置") && body.contains("xiaohong"),
        "{body}"
    );
    assert!(body.contains(r#"value="tasks:read""#), "{body}");
    assert!(!body.contains(r#"value="admin""#), "{body}");
    assert!(body.contains("还没有 API 密钥。"), "{body}");

    // No scope ticked: refused by name, in the reader's words; nothing made. The admin scope
    // sent anyway: refused.
    for form in [
        "name=%E5%90%8E%E5%8F%B0&expires=never",
        "name=x&scope=admin&expires=never",
    ] {
        let refused = htmx_form(&client, base, &token, "/settings/keys", form).await;
        assert_eq!(
            refused.headers().get("hx-retarget").unwrap(),
            "#key-messages"
        );
        let refused = refused.text().await.unwrap();
        assert!(refused.contains("权限范围"), "{form}: {refused}");
    }

    let made = htmx_form(
        &client,
        base,
        &token,
        "/settings/keys",
        "name=%E5%95%86%E5%93%81%E5%9B%BE%E5%90%8E%E5%8F%B0&scope=tasks:read&expires=30",
    )
    .await;
    let made = made.text().await.unwrap();
    let key = made
        .split(r#"data-testid="new-key">"#)
        .nth(1)
        .and_then(|rest| rest.split('<').next())
        .unwrap_or_default()
        .to_owned();
    assert!(
        key.starts_with(zhihui_domain::api_key::KEY_PREFIX),
        "{made}"
    );
    assert!(made.contains("商品图后台"), "{made}");
    assert_eq!(app.get_as(&key, "/api/v1/tasks").await.status(), 200);
    assert_eq!(app.get_as(&key, "/api/v1/account").await.status(), 403);
    // Shown once: the page drawn again lists it without the key.
    let body = page_of(&client, base, &token, "/settings").await;
    assert!(
        body.contains("商品图后台") && !body.contains(&key),
        "{body}"
    );

    let keys: serde_json::Value = app
        .get_as(&token, "/api/v1/me/keys")
        .await
        .json()
        .await
        .unwrap();
    let key_id = keys[0]["key_id"].as_str().unwrap();
    assert!(keys[0]["expires_at"].is_string(), "{keys}");
    let revoked = htmx_form(
        &client,
        base,
        &token,
        &format!("/settings/keys/{key_id}/revoke"),
        "",
    )
    .await;
    let revoked = revoked.text().await.unwrap();
    assert!(revoked.contains("已吊销"), "{revoked}");
    assert_eq!(app.get_as(&key, "/api/v1/tasks").await.status(), 401);

    // The password: the current one proves it is the reader.
    let wrong = htmx_form(
        &client,
        base,
        &token,
        "/settings/password",
        "current_password=not+it&new_password=a+new+horse+battery",
    )
    .await;
    let wrong = wrong.text().await.unwrap();
    assert!(wrong.contains("当前密码不正确。"), "{wrong}");
    let changed = htmx_form(
        &client,
        base,
        &token,
        "/settings/password",
        "current_password=correct+horse&new_password=a+new+horse+battery",
    )
    .await;
    assert_eq!(
        changed.headers().get("hx-redirect").unwrap(),
        "/login?changed=1&next=/settings"
    );
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 401);
    let (_, _, login) = page(
        &client,
        &format!("{base}/login?changed=1&next=/settings"),
        "zh-CN",
    )
    .await;
    assert!(login.contains("密码已修改，请用新密码登录。"), "{login}");
    app.login("xiaohong", "a new horse battery").await;
}

/// A user who signed up with a username binds a phone from the settings page (to log in with a
/// code after forgetting the password): the send button counts down to the next send, a wrong
/// code and a phone another account holds are refused in the card, and the bound phone logs in.
#[tokio::test]
async fn a_user_binds_a_phone_on_the_settings_page_and_logs_in_with_it() {
    let app = spawn_app().await;
    let (client, base) = (browser(), app.address.as_str());
    app.register("xiaohong", "correct horse").await;
    let token = app.login("xiaohong", "correct horse").await;
    let phone = "+8613800138000";
    let body = page_of(&client, base, &token, "/settings").await;
    assert!(
        body.contains("绑定手机号") && body.contains(r#"id="phone-card""#),
        "{body}"
    );

    let sent = htmx_form(
        &client,
        base,
        &token,
        "/settings/phone/code",
        "phone=13800138000",
    )
    .await;
    assert_eq!(sent.status(), 200);
    let sent = sent.text().await.unwrap();
    assert!(sent.contains("验证码已发送"), "{sent}");
    // The next send is a minute away: the button counts it down.
    assert!(sent.contains(r#"data-wait="60""#), "{sent}");
    assert!(sent.contains("重新发送（{seconds} 秒）"), "{sent}");
    assert!(
        !sent.contains(
            r#"name="code" inputmode="numeric" autocomplete="one-time-code" required disabled"#
        ),
        "{sent}"
    );
    let code = app.codes.last(phone).unwrap();

    // Half a minute later, again: too soon, and the wait left is counted down.
    app.clock.advance(Duration::from_secs(30));
    let again = htmx_form(
        &client,
        base,
        &token,
        "/settings/phone/code",
        "phone=13800138000",
    )
    .await;
    let again = again.text().await.unwrap();
    assert!(again.contains("验证码发送太频繁"), "{again}");
    assert!(again.contains(r#"data-wait="30""#), "{again}");
    assert_eq!(app.codes.count(phone), 1);

    let wrong_code = format!("{}{}", (code.as_bytes()[0] - b'0' + 1) % 10, &code[1..]);
    let wrong = htmx_form(
        &client,
        base,
        &token,
        "/settings/phone",
        &format!("phone=13800138000&code={wrong_code}"),
    )
    .await;
    let wrong = wrong.text().await.unwrap();
    assert!(
        wrong.contains("验证码不正确。") && wrong.contains(r#"value="13800138000""#),
        "{wrong}"
    );
    let me: serde_json::Value = app.get_as(&token, "/api/v1/me").await.json().await.unwrap();
    assert!(me["phone"].is_null(), "{me}");

    let bound = htmx_form(
        &client,
        base,
        &token,
        "/settings/phone",
        &format!("phone=13800138000&code={code}"),
    )
    .await;
    assert_eq!(
        bound.headers().get("hx-redirect").unwrap(),
        "/settings?phone_bound=1"
    );
    let body = page_of(&client, base, &token, "/settings?phone_bound=1").await;
    assert!(body.contains("手机号 +8613800138000 已绑定"), "{body}");
    assert!(!body.contains(r#"id="phone-card""#), "{body}");

    // Another account cannot have it.
    app.register("xiaolan", "correct horse").await;
    let other = app.login("xiaolan", "correct horse").await;
    app.clock.advance(Duration::from_secs(60));
    htmx_form(
        &client,
        base,
        &other,
        "/settings/phone/code",
        "phone=13800138000",
    )
    .await;
    let taken = htmx_form(
        &client,
        base,
        &other,
        "/settings/phone",
        &format!("phone=13800138000&code={}", app.codes.last(phone).unwrap()),
    )
    .await;
    let taken = taken.text().await.unwrap();
    assert!(taken.contains("这个手机号已被其他账号使用。"), "{taken}");

    // The bound phone logs the first user in.
    app.clock.advance(Duration::from_secs(60));
    app.post(
        "/api/v1/auth/code",
        None,
        &serde_json::json!({ "phone": phone }),
    )
    .await;
    let login: serde_json::Value = app
        .post(
            "/api/v1/auth/login",
            None,
            &serde_json::json!({ "phone": phone, "code": app.codes.last(phone).unwrap() }),
        )
        .await
        .json()
        .await
        .unwrap();
    let by_phone = login["token"].as_str().unwrap();
    let me_again: serde_json::Value = app
        .get_as(by_phone, "/api/v1/me")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(me_again["user_id"], me["user_id"], "{login}");

    // The login page's send button counts down too.
    let response = client
        .post(format!("{base}/login/code"))
        .header("Origin", base)
        .header("Accept", BROWSER_ACCEPT)
        .header("Cookie", "lang=zh")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("phone=13900139000")
        .send()
        .await
        .unwrap();
    let login_page = response.text().await.unwrap();
    assert!(login_page.contains(r#"data-wait="60""#), "{login_page}");
}

/// The reset page for a forgotten password, reached from the login page, in both languages;
/// a phone breaking its rule is said by name with what was typed kept; a signed-in reader goes
/// to their settings.
#[tokio::test]
async fn the_password_reset_page_is_linked_from_login_and_names_what_is_wrong() {
    let app = spawn_app().await;
    let (client, base) = (browser(), app.address.as_str());
    let (status, _, login) = page(&client, &format!("{base}/login"), "zh-CN").await;
    assert_eq!(status, 200);
    assert!(
        login.contains(r#"<a href="/password-reset">忘记密码？</a>"#),
        "{login}"
    );
    for (language, title) in [("zh-CN", "重设密码"), ("en", "Reset your password")] {
        let (status, _, reset) = page(&client, &format!("{base}/password-reset"), language).await;
        assert_eq!(status, 200);
        assert!(reset.contains(title), "{reset}");
    }
    let refused = client
        .post(format!("{base}/password-reset/code"))
        .header("Origin", base)
        .header("Accept", BROWSER_ACCEPT)
        .header("Cookie", "lang=zh")
        .header("Content-Type", "application/x-www-form-urlencoded")
        .body("phone=2025550123")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    let refused = refused.text().await.unwrap();
    assert!(
        refused.contains("手机号") && refused.contains(r#"value="2025550123""#),
        "{refused}"
    );

    app.register("xiaohong", "correct horse").await;
    let token = app.login("xiaohong", "correct horse").await;
    let signed_in = client
        .get(format!("{base}/password-reset"))
        .header("Accept", BROWSER_ACCEPT)
        .header("Cookie", format!("lang=zh; zhihui_session={token}"))
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status(), 303);
    assert_eq!(signed_in.headers().get("location").unwrap(), "/settings");
}

/// An admin looking up something that is no code gets told so in their language, on the page
/// (not an error page), naming what they typed.
#[tokio::test]
async fn the_audit_page_names_a_code_that_is_none_in_the_readers_language() {
    let app = spawn_app().await;
    let admin = app.admin_token("chazhang").await;
    for (lang, expected) in [
        ("zh", "“ZZZZZZZZZZ”不是有效的兑换码"),
        ("en", "“ZZZZZZZZZZ” is not a valid code"),
    ] {
        let response = browser()
            .get(format!("{}/admin/audit?code=ZZZZZZZZZZ", app.address))
            .header("Cookie", format!("lang={lang}; zhihui_session={admin}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let page = response.text().await.unwrap();
        assert!(page.contains(expected), "{page}");
        assert!(!page.contains("malformed or forged"), "{page}");
    }
}

#[tokio::test]
async fn a_user_chooses_a_chinese_display_name_on_the_settings_page_and_their_page_shows_it() {
    let app = spawn_app().await;
    let (client, base) = (browser(), app.address.as_str());
    let user = app.register("xiaohong", "correct horse").await;
    let token = app.login("xiaohong", "correct horse").await;
    let body = page_of(&client, base, &token, "/settings").await;
    assert!(
        body.contains(r#"id="display-name-form""#) && body.contains("保存昵称"),
        "{body}"
    );
    let form = |name: &str| {
        format!(
            "display_name={}",
            url::form_urlencoded::byte_serialize(name.as_bytes()).collect::<String>()
        )
    };

    // Refused: why, in the form, with what was typed kept.
    let refused = htmx_form(
        &client,
        base,
        &token,
        "/settings/display-name",
        &form("小红#1"),
    )
    .await;
    assert_eq!(refused.status(), 200);
    let refused = refused.text().await.unwrap();
    assert!(
        refused.contains("昵称：不能含 #") && refused.contains(r#"value="小红#1""#),
        "{refused}"
    );
    let me: serde_json::Value = app.get_as(&token, "/api/v1/me").await.json().await.unwrap();
    assert!(me["display_name"].is_null(), "{me}");

    let saved = htmx_form(
        &client,
        base,
        &token,
        "/settings/display-name",
        &form(" 小红的画册 "),
    )
    .await;
    assert_eq!(
        saved.headers().get("hx-redirect").unwrap(),
        "/settings?renamed=1"
    );
    let body = page_of(&client, base, &token, "/settings?renamed=1").await;
    assert!(body.contains("昵称已改为“小红的画册”"), "{body}");
    assert!(body.contains(r#"value="小红的画册""#), "{body}");
    // The header names the reader by it.
    assert!(
        body.contains(
            r#"id="who-name" href="/settings" title="账号设置" aria-current="page">小红的画册</a>"#
        ),
        "{body}"
    );
    // Their public page: the name, and the username beside it (names are not unique).
    let profile = page_of(&client, base, &token, &format!("/gallery/creators/{user}")).await;
    assert!(
        profile.contains(r#"<h1 id="creator-name">小红的画册</h1>"#)
            && profile.contains("@xiaohong"),
        "{profile}"
    );

    // Admins find the account by what it logs in with, and see what it shows.
    let admin = app.admin_token("guanli").await;
    let detail = page_of(&client, base, &admin, &format!("/admin/users/{user}")).await;
    assert!(
        detail.contains("<h1>xiaohong</h1>") && detail.contains("在画廊显示为“小红的画册”"),
        "{detail}"
    );

    // Emptied: the username again.
    let cleared = htmx_form(&client, base, &token, "/settings/display-name", &form("")).await;
    assert_eq!(
        cleared.headers().get("hx-redirect").unwrap(),
        "/settings?renamed=1"
    );
    let body = page_of(&client, base, &token, "/settings?renamed=1").await;
    assert!(body.contains("昵称已清除"), "{body}");
    let profile = page_of(&client, base, &token, &format!("/gallery/creators/{user}")).await;
    assert!(
        profile.contains(r#"<h1 id="creator-name">xiaohong</h1>"#)
            && !profile.contains("@xiaohong"),
        "{profile}"
    );
}

#[tokio::test]
async fn a_phone_user_sets_a_username_and_password_on_the_settings_page() {
    let app = spawn_app().await;
    let (client, base) = (browser(), app.address.as_str());
    app.register("xiaohong", "correct horse").await;
    let phone = "+8613800138009";
    app.post(
        "/api/v1/auth/code",
        None,
        &serde_json::json!({"phone": phone}),
    )
    .await;
    let login: serde_json::Value = app
        .post(
            "/api/v1/auth/login",
            None,
            &serde_json::json!({"phone": phone, "code": app.codes.last(phone).unwrap()}),
        )
        .await
        .json()
        .await
        .unwrap();
    let token = login["token"].as_str().unwrap().to_owned();
    let body = page_of(&client, base, &token, "/settings").await;
    assert!(
        body.contains(r#"id="username-form""#) && body.contains("设置用户名和密码"),
        "{body}"
    );
    // Without a username, an empty display name shows a short id: the hint says so.
    assert!(body.contains("不填则显示“user#”加一串编号"), "{body}");

    let refused = htmx_form(
        &client,
        base,
        &token,
        "/settings/username",
        "username=xiaoyu&password=short",
    )
    .await
    .text()
    .await
    .unwrap();
    assert!(
        refused.contains("密码：") && refused.contains(r#"value="xiaoyu""#),
        "{refused}"
    );
    let taken = htmx_form(
        &client,
        base,
        &token,
        "/settings/username",
        "username=XiaoHong&password=correct+horse+2",
    )
    .await
    .text()
    .await
    .unwrap();
    assert!(taken.contains("这个用户名已被使用"), "{taken}");

    let set = htmx_form(
        &client,
        base,
        &token,
        "/settings/username",
        "username=xiaoyu&password=correct+horse+2",
    )
    .await;
    assert_eq!(
        set.headers().get("hx-redirect").unwrap(),
        "/settings?username_set=1"
    );
    let body = page_of(&client, base, &token, "/settings?username_set=1").await;
    assert!(
        body.contains("现在也可以用用户名 xiaoyu 和密码登录了。"),
        "{body}"
    );
    assert!(body.contains("不填则显示用户名"), "{body}");
    // Now it has a password to change, and no form to set a username.
    assert!(
        body.contains(r#"action="/settings/password""#) && !body.contains(r#"id="username-form""#),
        "{body}"
    );
    let again = app.login("xiaoyu", "correct horse 2").await;
    let me: serde_json::Value = app.get_json(&again, "/api/v1/me").await;
    assert_eq!(me["id"], login["user"]["id"]);

    // Its password forgotten while signed in: out, on to the reset with a code to the phone.
    assert!(body.contains("忘记当前密码？"), "{body}");
    let out = htmx_form(&client, base, &token, "/logout/password-reset", "").await;
    assert_eq!(out.headers().get("hx-redirect").unwrap(), "/password-reset");
    assert_eq!(app.get_as(&token, "/api/v1/me").await.status(), 401);
    // A reader without a phone has no code to reset with: no such button.
    let other = app.login("xiaohong", "correct horse").await;
    let body = page_of(&client, base, &other, "/settings").await;
    assert!(!body.contains("忘记当前密码？"), "{body}");
}
