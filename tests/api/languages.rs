//! Chinese is our users' language: every place user text in any script travels, end to end.
//!
//! Places checked, one test each:
//! - the prompt through the whole task path (translation absent or answering, the workflow, the
//!   ComfyUI server's PNG metadata, the labels, the task view and the task list's pages);
//! - the ComfyUI simulator's PNG `prompt` chunk, byte for byte what Python's `json.dumps` writes;
//! - the ledger's reasons (API pages and `zhihui audit account`, table and JSON);
//! - a code batch's note (the batch view) and its CSV export;
//! - a promotion's title (through the Redis gate and back);
//! - socket notices carrying a reason;
//! - the access log's request line (secrets redacted, other text kept).
//!
//! Failure reasons cut short on a character, never inside one: `dispatch::saga::settle` tests.

#![allow(clippy::unwrap_used)]

use comfyui_sim::Faults;
use futures::StreamExt;
use serde_json::{Value, json};
use zhihui::labels::metadata;
use zhihui_domain::task::{TaskEvent, TaskStatus};

use crate::dispatch::{
    assert_settled, drive_until, drive_until_connected, drive_until_idle, harness_configured,
};
use crate::helpers::{dead_port, spawn_app};
use crate::tasks::{funded_user, submit, task_events};

/// Prompts as people type them: Chinese, Japanese, Korean, Arabic, emoji alone, scripts mixed,
/// and Chinese with the characters that would break a hand-made JSON template.
const PROMPTS: &[&str] = &[
    "一只在雪地里奔跑的红狐狸，电影感光线，超高清",
    "雪の中を走る赤いキツネ、映画のような光",
    "눈 속을 달리는 붉은 여우",
    "ثعلب أحمر يركض في الثلج",
    "🦊❄️✨🌕",
    "a 红色 fox 🦊 running in 雪の中, 8k",
    "引号\"和反斜杠\\ 换行\n}, \"99\": {\"class_type\": \"SaveImage\"",
];

/// The ASCII JSON Python's `json.dumps` writes for `text` (a JSON document): ComfyUI's
/// SaveImage metadata. The machine's CPython answers, not our own encoder.
fn python_json_dumps(text: &str) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("python3")
        .args([
            "-c",
            "import json,sys; sys.stdout.write(json.dumps(json.loads(sys.stdin.read())))",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs (it is on every machine of this project)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success());
    String::from_utf8(output.stdout).unwrap()
}

/// Every PNG the simulators wrote under `directory`, with its `tEXt` chunks.
fn written_pngs(directory: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<(String, String)>)> {
    let mut found = Vec::new();
    let mut pending = vec![directory.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.map(Result::unwrap) {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|ext| ext == "png") {
                let bytes = std::fs::read(&path).unwrap();
                let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
                decoder.set_ignore_text_chunk(false);
                let reader = decoder.read_info().unwrap();
                let texts = reader
                    .info()
                    .uncompressed_latin1_text
                    .iter()
                    .map(|chunk| (chunk.keyword.clone(), chunk.text.clone()))
                    .collect();
                found.push((path, texts));
            }
        }
    }
    found
}

/// Every prompt of [`PROMPTS`] (with a Chinese negative prompt) becomes a labelled image and is
/// charged once, the ComfyUI server's metadata is ASCII JSON as `json.dumps` writes it, and the
/// user's views show the text as typed. `translating`: the fake Ollama answers; else nothing
/// listens where Ollama should be (a new machine).
async fn prompts_in_every_script_become_labelled_images(translating: bool) {
    let ollama_port = dead_port();
    let harness = harness_configured(1, Faults::default(), move |settings| {
        if !translating {
            settings.translation.ollama_url = format!("http://127.0.0.1:{ollama_port}");
        }
        settings.labels.content_producer = "智绘科技".into();
    })
    .await;
    let app = &harness.app;
    let count = PROMPTS.len() as i64;
    let (user, token) = funded_user(app, "xiaoming", &count.to_string()).await;
    let process = harness.process();
    let mut saga = harness.lead(&process).await;
    drive_until_connected(&mut saga, 1).await;

    let mut tasks = Vec::new();
    for prompt in PROMPTS {
        let response = submit(
            app,
            &token,
            &json!({"prompt": prompt, "negative_prompt": "模糊，低质量，多余的手指", "steps": 2}),
            None,
        )
        .await;
        assert_eq!(response.status(), 201, "{prompt}");
        let body: Value = response.json().await.unwrap();
        tasks.push(body["task_id"].as_str().unwrap().to_owned());
    }
    drive_until(&mut saga, &process, &tasks, &[TaskStatus::Succeeded]).await;
    drive_until_idle(&mut saga).await;
    // One point each, charged once; nothing frozen; audit verify clean.
    assert_settled(&harness, &process, &user, 0).await;
    if translating {
        // The emoji-only prompt has no letters to translate; every other text was asked once,
        // the shared negative prompt once (then cached).
        assert_eq!(app.ollama.calls(), PROMPTS.len() - 1 + 1);
    }

    // What the ComfyUI server wrote: `prompt` (and nothing else of ours) as json.dumps does.
    let written = written_pngs(&harness.directory.0.join("sim-0"));
    assert_eq!(written.len(), PROMPTS.len());
    for (path, texts) in &written {
        let (keyword, text) = &texts[0];
        assert_eq!(keyword, "prompt", "{path:?}");
        assert!(text.is_ascii(), "{path:?}: {text}");
        assert_eq!(*text, python_json_dumps(text), "{path:?}");
    }

    for (task, prompt) in tasks.iter().zip(PROMPTS) {
        let events = task_events(app, task).await;
        let TaskEvent::Submitted(submitted) = &events[0] else {
            panic!("first event {:?}", events[0]);
        };
        let text_written = written
            .iter()
            .find(|(path, _)| path.to_string_lossy().contains(task.as_str()))
            .map(|(_, texts)| texts[0].1.clone())
            .unwrap();
        let graph: Value = serde_json::from_str(&text_written).unwrap();
        assert_eq!(graph["6"]["inputs"]["text"], submitted.prompt_used);
        assert_eq!(graph["7"]["inputs"]["text"], submitted.negative_prompt_used);
        if !translating {
            assert!(submitted.prompt_used.ends_with(prompt), "{prompt}");
        }

        // The owner's view: the text as typed; the image labelled, ComfyUI's graph gone.
        let view: Value = app
            .get_as(&token, &format!("/api/v1/tasks/{task}"))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(view["prompt"], *prompt);
        assert_eq!(view["negative_prompt"], "模糊，低质量，多余的手指");
        let url = view["images"][0]["url"].as_str().unwrap();
        let served = app.get_as(&token, url).await.bytes().await.unwrap();
        let labels = metadata::read(&served).unwrap();
        let label = labels.png_text.expect("the AIGC tEXt chunk");
        assert_eq!(label.content_producer, "智绘科技");
        assert_eq!(labels.xmp.as_ref(), Some(&label));
        assert!(labels.other_text_keywords.is_empty(), "{task}");
    }

    // The task list, two per page, newest first: every prompt comes back whole.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(cursor) => format!("/api/v1/tasks?limit=2&cursor={cursor}"),
            None => "/api/v1/tasks?limit=2".to_owned(),
        };
        let page: Value = app.get_as(&token, &path).await.json().await.unwrap();
        for item in page["tasks"].as_array().unwrap() {
            seen.push(item["prompt"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    let mut expected: Vec<String> = PROMPTS.iter().map(|p| (*p).to_owned()).collect();
    expected.reverse();
    assert_eq!(seen, expected);
    saga.resign().await;
}

#[tokio::test]
async fn prompts_in_every_script_become_labelled_images_with_no_ollama_running() {
    Box::pin(prompts_in_every_script_become_labelled_images(false)).await;
}

#[tokio::test]
async fn prompts_in_every_script_become_labelled_images_with_ollama_translating() {
    Box::pin(prompts_in_every_script_become_labelled_images(true)).await;
}

#[tokio::test]
async fn chinese_reasons_notes_and_titles_come_back_as_written() {
    let app = spawn_app().await;
    let admin = app.admin_token("yunying").await;
    let (user, token) = funded_user(&app, "xiaohong", "1").await;

    // Ledger reasons: the API's pages and the audit CLI, table and JSON.
    let reason = "新用户奖励：欢迎来到智绘 🎉（第一期）";
    let granted = app
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(&admin),
            &json!({"amount": "12.50", "reason": reason}),
        )
        .await;
    assert_eq!(granted.status(), 201, "{}", granted.text().await.unwrap());
    let ledger: Value = app
        .get_as(&token, "/api/v1/account/ledger?limit=10")
        .await
        .json()
        .await
        .unwrap();
    let reasons: Vec<&str> = ledger["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|entry| entry["reason"].as_str())
        .collect();
    assert!(reasons.contains(&reason), "{ledger}");
    app.project().await;
    let table = app.cli(&["audit", "account", &user]);
    assert!(table.status.success());
    assert!(String::from_utf8(table.stdout).unwrap().contains(reason));
    let json_out = app.cli(&["audit", "account", &user, "--json"]);
    assert!(json_out.status.success());
    assert!(String::from_utf8(json_out.stdout).unwrap().contains(reason));

    // A reason of 200 Chinese characters is within the rule (counted in characters); 201 is
    // refused naming the field.
    let long = "奖".repeat(200);
    let accepted = app
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(&admin),
            &json!({"amount": "1", "reason": long}),
        )
        .await;
    assert_eq!(accepted.status(), 201);
    let refused = app
        .post(
            &format!("/api/v1/admin/accounts/{user}/grants"),
            Some(&admin),
            &json!({"amount": "1", "reason": format!("{long}奖")}),
        )
        .await;
    assert_eq!(refused.status(), 422);
    assert!(refused.text().await.unwrap().contains("reason"));

    // A code batch's note: kept as written; its CSV export is ASCII and whole.
    let now = app.clock.now();
    let created = app
        .post(
            "/api/v1/admin/code-batches",
            Some(&admin),
            &json!({"count": 3, "points": "5", "valid_from": now - chrono::Duration::hours(1),
                    "valid_until": now + chrono::Duration::days(7), "note": "双十一合作伙伴兑换码（北京）"}),
        )
        .await;
    assert_eq!(created.status(), 202, "{}", created.text().await.unwrap());
    let batch: Value = created.json().await.unwrap();
    let batch_id = batch["batch_id"].as_str().unwrap().to_owned();
    let services = app.services();
    zhihui::points::codes::issuer::CodeIssuer::new(services.codes.clone())
        .issue_batch(uuid::Uuid::parse_str(&batch_id).unwrap(), None)
        .await
        .unwrap();
    let view: Value = app
        .get_as(&admin, &format!("/api/v1/admin/code-batches/{batch_id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(view["note"], "双十一合作伙伴兑换码（北京）");
    assert_eq!(view["issued"], 3);
    let csv = app
        .get_as(
            &admin,
            &format!("/api/v1/admin/code-batches/{batch_id}/codes.csv"),
        )
        .await;
    assert_eq!(csv.status(), 200);
    let csv = csv.text().await.unwrap();
    assert!(csv.is_ascii());
    assert_eq!(csv.lines().count(), 4, "{csv}");

    // A promotion's title goes through the Redis gate's scripts and comes back whole.
    let title = "限时抢购：新人礼包 🎁";
    let promotion = app
        .post(
            "/api/v1/admin/promotions",
            Some(&admin),
            &json!({"title": title, "points": "10", "price": "0", "stock": 5,
                    "starts_at": now - chrono::Duration::minutes(1),
                    "ends_at": now + chrono::Duration::hours(1)}),
        )
        .await;
    assert_eq!(
        promotion.status(),
        201,
        "{}",
        promotion.text().await.unwrap()
    );
    app.project().await;
    let open: Value = app
        .get_as(&token, "/api/v1/promotions")
        .await
        .json()
        .await
        .unwrap();
    assert!(open.to_string().contains(title), "{open}");

    // A notice with a Chinese reason reaches its owner's socket as written.
    let mut socket = app.socket(&token).await;
    let task_id: zhihui_domain::task::TaskId = uuid::Uuid::now_v7();
    let user_id = zhihui_domain::user::UserId::from_uuid(uuid::Uuid::parse_str(&user).unwrap());
    let reason = "图像服务器显存不足，请稍后再试 🙏";
    // Published until heard: the socket subscribes as it opens.
    let heard = loop {
        services
            .notifier
            .tell(
                user_id,
                task_id,
                zhihui::platform::notify::TaskNotice::Failed {
                    reason: reason.into(),
                },
            )
            .await;
        if let Ok(Some(Ok(frame))) =
            tokio::time::timeout(std::time::Duration::from_millis(500), socket.next()).await
            && let async_tungstenite::tungstenite::Message::Text(text) = frame
        {
            break serde_json::from_str::<Value>(text.as_str()).unwrap();
        }
    };
    assert_eq!(heard["type"], "failed");
    assert_eq!(heard["reason"], reason);
    let balance = crate::tasks::account_of(&app, &user).await.balance;
    // 1 + 12.50 + 1 granted; the refused grant moved nothing.
    assert_eq!(
        balance.available.as_decimal(),
        rust_decimal::Decimal::new(1_450, 2)
    );
}

#[test]
fn the_access_log_keeps_other_text_and_redacts_secrets_next_to_it() {
    let line = zhihui::http::redacted_request_line(
        "GET",
        "/api/v1/tasks/%E4%B8%80%E5%8F%AA%E7%8C%AB",
        "q=%E7%BA%A2%E7%8B%90%E7%8B%B8&token=秘密令牌&%74oken=x&标签=猫",
        actix_web::http::Version::HTTP_11,
    );
    assert_eq!(
        line,
        "GET /api/v1/tasks/%E4%B8%80%E5%8F%AA%E7%8C%AB?q=%E7%BA%A2%E7%8B%90%E7%8B%B8&token=REDACTED&%74oken=REDACTED&标签=猫 HTTP/1.1"
    );
}

/// A problem's words in the client's language: Chinese when `Accept-Language` prefers it, the
/// API's English otherwise (none, English first, or only languages we lack); the names programs
/// match on (`type`, `rule`, `field`, each error's `field` and `rule`) the same in both.
#[tokio::test]
async fn api_problems_are_said_in_chinese_when_the_client_asks_and_in_english_otherwise() {
    let app = spawn_app().await;
    let (_, token) = funded_user(&app, "xiaohong", "1").await;
    let ask = |path: &str, body: Value, language: Option<&str>| {
        let mut request = app
            .http
            .post(format!("{}{path}", app.address))
            .bearer_auth(&token)
            .json(&body);
        if let Some(language) = language {
            request = request.header("accept-language", language);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let said = response
                .headers()
                .get("content-language")
                .map(|value| value.to_str().unwrap().to_owned());
            (status, said, response.json::<Value>().await.unwrap())
        }
    };
    let bad_task = json!({"prompt": "", "images": 9, "steps": 0, "resolution": "100x100"});
    let names = |problem: &Value| {
        let errors: Vec<(String, String)> = problem["errors"]
            .as_array()
            .map(|errors| {
                errors
                    .iter()
                    .map(|e| (e["field"].to_string(), e["rule"].to_string()))
                    .collect()
            })
            .unwrap_or_default();
        (
            problem["type"].clone(),
            problem["field"].clone(),
            problem["rule"].clone(),
            errors,
        )
    };

    let (status, said, chinese) = ask(
        "/api/v1/tasks",
        bad_task.clone(),
        Some("zh-CN,zh;q=0.9,en;q=0.8"),
    )
    .await;
    assert_eq!((status, said.as_deref()), (422, Some("zh-CN")), "{chinese}");
    assert_eq!(chinese["title"], "请求无效");
    let messages: Vec<&str> = chinese["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|error| error["message"].as_str().unwrap())
        .collect();
    assert!(messages[0].starts_with("提示词："), "{messages:?}");
    assert!(
        messages.iter().all(|message| !message.is_ascii()),
        "{messages:?}"
    );
    assert!(chinese["detail"].as_str().unwrap().contains("提示词："));

    for english_first in [None, Some("en-US,en;q=0.9,zh;q=0.5"), Some("fr-FR")] {
        let (status, said, english) = ask("/api/v1/tasks", bad_task.clone(), english_first).await;
        assert_eq!((status, said), (422, None), "{english_first:?}");
        assert_eq!(english["title"], "Invalid request");
        assert!(
            english["detail"].as_str().unwrap().starts_with("prompt: "),
            "{english}"
        );
        assert_eq!(names(&english), names(&chinese));
    }

    // A named rule, and a window said with its times.
    let (status, _, invalid) = ask(
        "/api/v1/codes/redeem",
        json!({"code": "不是兑换码"}),
        Some("zh"),
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(invalid["type"], "/problems/invalid-code");
    assert_eq!(invalid["detail"], "兑换码无效：请检查是否输错了字符。");
    let (status, _, missing) = ask(
        &format!("/api/v1/tasks/{}/cancel", uuid::Uuid::now_v7()),
        json!({}),
        Some("zh-TW"),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(
        (missing["title"].as_str(), missing["detail"].as_str()),
        (Some("未找到"), Some("找不到这个页面或内容。"))
    );
    // No credentials: the 401 too.
    let unauthenticated = app
        .http
        .get(format!("{}/api/v1/account", app.address))
        .header("accept-language", "zh-CN")
        .send()
        .await
        .unwrap();
    assert_eq!(unauthenticated.status(), 401);
    assert!(unauthenticated.headers().contains_key("www-authenticate"));
    let problem: Value = unauthenticated.json().await.unwrap();
    assert_eq!(problem["detail"], "请先登录。");
}
