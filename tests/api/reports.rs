//! Reports of works to the admins: once per user per work under a double click on two
//! processes, each refusal named, the admins' queue from the read model, a dismissal and a hiding
//! each closing the reports they should (also a report that reaches a work hidden meanwhile), and
//! `audit verify` agreeing; the same from the pages.

#![allow(clippy::unwrap_used)]

use serde_json::{Value, json};
use uuid::Uuid;
use zhihui_domain::gallery::report::{
    Report, ReportCommand, ReportNote, ReportReason, report_stream,
};
use zhihui_domain::user::UserId;

use crate::gallery::{
    gallery_harness, json_of, member, page_post, page_text, publish, succeeded_tasks,
};
use crate::helpers::TestApp;
use crate::tasks::funded_user;

async fn report(app: &TestApp, token: &str, work: &str, body: Value) -> reqwest::Response {
    app.http
        .put(format!(
            "{}/api/v1/gallery/works/{work}/report",
            app.address
        ))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap()
}

async fn problem(response: reqwest::Response, status: u16) -> Value {
    assert_eq!(response.status(), status);
    response.json().await.unwrap()
}

async fn queue(app: &TestApp, admin: &str) -> Vec<Value> {
    let body = json_of(app.get_as(admin, "/api/v1/admin/gallery/reports").await).await;
    body["works"].as_array().unwrap().clone()
}

async fn statuses(app: &TestApp, work: &str) -> Vec<String> {
    let client = crate::helpers::connect(&app.settings).await;
    client
        .query(
            "SELECT status FROM work_reports WHERE work_id = $1 ORDER BY reported_at",
            &[&Uuid::parse_str(work).unwrap()],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn a_report_is_made_once_on_two_processes_and_an_admin_dismisses_or_hides_what_was_reported()
{
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "huajia", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 2)).await;
    let rainy = publish(app, &creator, &tasks[0], "江南雨巷", true).await;
    let market = publish(app, &creator, &tasks[1], "夜市烟火", true).await;
    let second = app.another_instance().await;
    let (_, xiaohong) = member(app, "xiaohong").await;
    let (_, xiaoming) = member(app, "xiaoming").await;
    let (_, xiaogang) = member(app, "xiaogang").await;
    let admin = app.admin_token("shenhe").await;

    // Each refusal names its rule; none leaves a report behind.
    let own = problem(
        report(app, &creator, &rainy, json!({"reason": "spam"})).await,
        422,
    )
    .await;
    assert_eq!(own["type"], "/problems/reporting-own-work", "{own}");
    let unknown = problem(
        report(app, &xiaohong, &rainy, json!({"reason": "难看"})).await,
        422,
    )
    .await;
    assert_eq!(
        (unknown["field"].as_str(), unknown["rule"].as_str()),
        (Some("reason"), Some("one_of")),
        "{unknown}"
    );
    let bare_other = problem(
        report(
            app,
            &xiaohong,
            &rainy,
            json!({"reason": "other", "note": "  "}),
        )
        .await,
        422,
    )
    .await;
    assert_eq!(
        (bare_other["field"].as_str(), bare_other["rule"].as_str()),
        (Some("note"), Some("report_note_required")),
        "{bare_other}"
    );
    let long = problem(
        report(
            app,
            &xiaohong,
            &rainy,
            json!({"reason": "other", "note": "字".repeat(201)}),
        )
        .await,
        422,
    )
    .await;
    assert_eq!(long["rule"], "length_at_most", "{long}");
    problem(
        report(
            app,
            &xiaohong,
            &Uuid::now_v7().to_string(),
            json!({"reason": "spam"}),
        )
        .await,
        404,
    )
    .await;

    // A double click reaching both processes, ten times over: one report.
    let sexual = json!({"reason": "sexual", "note": "画面低俗，不适合公开"});
    let answers = futures::future::join_all((0..10).map(|index| {
        let process = if index % 2 == 0 { app } else { &second };
        report(process, &xiaohong, &rainy, sexual.clone())
    }))
    .await;
    for answer in answers {
        assert_eq!(answer.status(), 204);
    }
    let xiaohong_id = json_of(app.get_as(&xiaohong, "/api/v1/me").await).await["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let store = app.services().event_store;
    let stream = format!("report-{rainy}-{xiaohong_id}");
    let events = zhihui::platform::event_store::read_whole_stream(&store, &stream)
        .await
        .unwrap();
    assert_eq!(events.len(), 1, "one report recorded");
    // Another report of the same work by the same user is refused, on either process.
    let again = problem(
        report(&second, &xiaohong, &rainy, json!({"reason": "violent"})).await,
        409,
    )
    .await;
    assert_eq!(again["type"], "/problems/already-reported", "{again}");

    // A minute on (the clock stands still here): the queue orders reports by their time.
    app.clock.advance(std::time::Duration::from_secs(60));
    let other = json!({"reason": "other", "note": "盗用了我的原创角色“小雨”"});
    assert_eq!(
        report(&second, &xiaoming, &rainy, other).await.status(),
        204
    );
    assert_eq!(
        report(app, &xiaogang, &market, json!({"reason": "spam"}))
            .await
            .status(),
        204
    );

    // The admins' queue: the most reported first, reasons counted, notes in order.
    assert_eq!(
        app.get_as(&xiaohong, "/api/v1/admin/gallery/reports")
            .await
            .status(),
        403
    );
    app.project().await;
    let works = queue(app, &admin).await;
    assert_eq!(works.len(), 2, "{works:?}");
    assert_eq!(works[0]["work_id"], rainy.as_str());
    assert_eq!(works[0]["title"], "江南雨巷");
    assert_eq!(works[0]["reports"], 2);
    assert_eq!(
        works[0]["reasons"],
        json!([{"reason": "sexual", "reports": 1}, {"reason": "other", "reports": 1}])
    );
    assert_eq!(
        works[0]["notes"],
        json!(["画面低俗，不适合公开", "盗用了我的原创角色“小雨”"])
    );
    assert_eq!(works[1]["work_id"], market.as_str());
    // Its picture as the public sees it, labelled.
    let cover = app
        .get_as(&admin, works[0]["cover"].as_str().unwrap())
        .await;
    assert_eq!(cover.status(), 200);
    assert_eq!(cover.headers()["x-aigc-label"], "1");

    // Dismissed on the other process: off the queue; a second dismissal finds nothing open.
    let dismiss = format!("/api/v1/admin/gallery/works/{market}/reports/dismiss");
    let dismissed = json_of(second.post(&dismiss, Some(&admin), &json!({})).await).await;
    assert_eq!(dismissed["dismissed"], 1);
    app.project().await;
    let again = json_of(app.post(&dismiss, Some(&admin), &json!({})).await).await;
    assert_eq!(again["dismissed"], 0);
    assert_eq!(statuses(app, &market).await, ["dismissed"]);
    // Someone else's report of it afterwards is a new one for the queue.
    assert_eq!(
        report(app, &xiaohong, &market, json!({"reason": "infringement"}))
            .await
            .status(),
        204
    );
    app.project().await;
    let works = queue(app, &admin).await;
    assert_eq!(works.len(), 2);
    assert_eq!(works[1]["work_id"], market.as_str());
    assert_eq!(works[1]["reports"], 1);

    // Hidden: its reports are upheld and it leaves the queue; it cannot be reported any more.
    let hide = app
        .post(
            &format!("/api/v1/admin/gallery/works/{rainy}/hide"),
            Some(&admin),
            &json!({"reason": "违反社区规范：色情低俗"}),
        )
        .await;
    assert_eq!(hide.status(), 204);
    // Off the queue at once on the process that hid it, before the read model has the hide.
    let works = queue(app, &admin).await;
    assert_eq!(works.len(), 1, "{works:?}");
    assert_eq!(works[0]["work_id"], market.as_str());
    // A report decided while the work was still visible, recorded just after the hiding.
    let me = json_of(app.get_as(&xiaogang, "/api/v1/me").await).await;
    let late = UserId::from_uuid(Uuid::parse_str(me["id"].as_str().unwrap()).unwrap());
    let rainy_id = Uuid::parse_str(&rainy).unwrap();
    zhihui::platform::command::execute::<Report>(
        &store,
        &report_stream(rainy_id, late),
        &ReportCommand::Report {
            work_id: rainy_id,
            reporter: late,
            work_visible: true,
            own_work: false,
            reason: ReportReason::Violent,
            note: ReportNote::parse("").unwrap(),
            at: app.clock.now(),
        },
        &zhihui::platform::event_store::EventMetadata {
            correlation_id: Uuid::now_v7(),
            causation_id: None,
            actor: "test:late-report".into(),
        },
        zhihui::platform::command::RetryPolicy::default(),
    )
    .await
    .unwrap();
    app.project().await;
    assert_eq!(statuses(app, &rainy).await, ["upheld", "upheld", "upheld"]);
    let works = queue(app, &admin).await;
    assert_eq!(works.len(), 1);
    assert_eq!(works[0]["work_id"], market.as_str());
    problem(
        report(&second, &xiaoming, &rainy, json!({"reason": "spam"})).await,
        404,
    )
    .await;

    let verified = app.verify(None).await;
    assert!(
        verified.differences.is_empty(),
        "{:?}",
        verified.differences
    );
    // The queue is a fold of the events: rebuilt from them, row for row the same.
    let rows = || async {
        let client = crate::helpers::connect(&app.settings).await;
        client
            .query(
                "SELECT work_id, reporter, reason, note, reported_at, status, resolved_by,
                        resolved_at
                   FROM work_reports ORDER BY work_id, reporter",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| {
                format!(
                    "{:?} {:?} {:?} {:?} {:?} {:?} {:?} {:?}",
                    row.get::<_, Uuid>(0),
                    row.get::<_, Uuid>(1),
                    row.get::<_, String>(2),
                    row.get::<_, Option<String>>(3),
                    row.get::<_, chrono::DateTime<chrono::Utc>>(4),
                    row.get::<_, String>(5),
                    row.get::<_, Option<Uuid>>(6),
                    row.get::<_, Option<chrono::DateTime<chrono::Utc>>>(7),
                )
            })
            .collect::<Vec<_>>()
    };
    let live = rows().await;
    assert_eq!(live.len(), 5);
    let services = app.services();
    zhihui::cli::replay::replay(
        &services.pg_pool,
        &services.event_store,
        zhihui_projections::ProjectionName::Gallery,
        &app.settings.projections,
        3,
        &mut zhihui::cli::replay::Quiet,
    )
    .await
    .unwrap();
    assert_eq!(rows().await, live);

    // Reports are paced per user.
    let paced = gallery_harness(|settings| settings.gallery.reports_per_hour = 2).await;
    let (_, quick) = member(&paced.app, "quick").await;
    let work = Uuid::now_v7().to_string();
    let mut answered = Vec::new();
    for _ in 0..3 {
        answered.push(
            report(&paced.app, &quick, &work, json!({"reason": "spam"}))
                .await
                .status()
                .as_u16(),
        );
    }
    assert_eq!(answered, [404, 404, 429]);
}

/// From the pages: a reader reports a work in Chinese through the form (htmx answers in the
/// form), the admin finds it in the queue with its reason and note, and hides it from there.
#[tokio::test]
async fn a_reader_reports_a_work_from_its_page_and_an_admin_hides_it_from_the_queue() {
    let harness = gallery_harness(|_| {}).await;
    let app = &harness.app;
    let (_, creator) = funded_user(app, "chuangzuo", "100").await;
    let tasks = Box::pin(succeeded_tasks(&harness, &creator, 1)).await;
    let work = publish(app, &creator, &tasks[0], "山间小屋", true).await;
    let (_, reader) = member(app, "duzhe").await;
    let admin = app.admin_token("guanli").await;

    // The work's page offers the form to a reader, not to its creator, and a visitor is sent
    // to log in first.
    let page = page_text(app, &reader, &format!("/gallery/works/{work}")).await;
    assert!(page.contains("举报原因"), "{page}");
    assert!(page.contains("侵犯版权或肖像"));
    let own = page_text(app, &creator, &format!("/gallery/works/{work}")).await;
    assert!(!own.contains("举报原因"));
    let visitor = app
        .http
        .get(format!("{}/gallery/works/{work}", app.address))
        .header("Cookie", "lang=zh")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(visitor.contains("登录后举报"));

    // Without a reason, the form says to choose one; with "other" and no note, it names the note.
    let path = format!("/gallery/works/{work}/report");
    let none = page_post(app, &reader, &path, &[("note", "")]).await;
    assert_eq!(none.status(), 422);
    // Without JavaScript, a refusal is the work's page again, the form open with the refusal in
    // it and the reader's choices kept.
    let none = none.text().await.unwrap();
    assert!(none.contains("请选择举报原因"), "{none}");
    assert!(none.contains(r#"<details class="report-work" open>"#));
    let long_note = "楼".repeat(201);
    let too_long = page_post(
        app,
        &reader,
        &path,
        &[("reason", "infringement"), ("note", &long_note)],
    )
    .await;
    assert_eq!(too_long.status(), 422);
    let too_long = too_long.text().await.unwrap();
    assert!(too_long.contains("最多 200 个字符"), "{too_long}");
    assert!(too_long.contains(r#"value="infringement" required checked"#));
    assert!(too_long.contains(&format!(r#"value="{long_note}""#)));
    assert!(too_long.contains("山间小屋"));
    let bare = htmx(app, &reader, &path, &[("reason", "other"), ("note", "")]).await;
    assert!(bare.contains("选择“其他”原因时必须填写"), "{bare}");
    let done = htmx(
        app,
        &reader,
        &path,
        &[("reason", "other"), ("note", "画的是我家，没经过同意")],
    )
    .await;
    assert!(done.contains("已收到你的举报"), "{done}");
    let twice = htmx(app, &reader, &path, &[("reason", "spam"), ("note", "")]).await;
    assert!(twice.contains("你已经举报过这件作品"), "{twice}");
    // Without htmx: back to the work, which says it was received.
    let (_, other) = member(app, "lingyige").await;
    let plain = page_post(app, &other, &path, &[("reason", "violent"), ("note", "")]).await;
    assert_eq!(plain.status(), 303);
    let landed = page_text(app, &other, &format!("/gallery/works/{work}?done=reported")).await;
    assert!(landed.contains("已收到你的举报"));
    let again = page_post(app, &other, &path, &[("reason", "spam"), ("note", "")]).await;
    assert_eq!(again.status(), 422);
    let again = again.text().await.unwrap();
    assert!(again.contains("你已经举报过这件作品"), "{again}");
    assert!(again.contains(r#"value="spam" required checked"#));

    // The admins' queue.
    app.project().await;
    let queue = page_text(app, &admin, "/admin/reports").await;
    assert!(queue.contains("山间小屋"), "{queue}");
    assert!(queue.contains("2 次举报"));
    assert!(queue.contains("画的是我家，没经过同意"));
    assert!(queue.contains("其他 × 1"));
    assert!(
        queue.contains("违反社区规范："),
        "the hide reason is filled in"
    );
    let overview = page_text(app, &admin, "/admin").await;
    assert!(
        overview.contains(r#"data-testid="works-reported">1<"#),
        "{overview}"
    );
    let refused = app
        .http
        .get(format!("{}/admin/reports", app.address))
        .header("Cookie", format!("lang=zh; zhihui_session={reader}"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);

    // Hidden from the queue: back to it, the work gone from it.
    let hidden = page_post(
        app,
        &admin,
        &format!("/gallery/works/{work}/hide"),
        &[
            ("reason", "违反社区规范：未经同意画他人住宅"),
            ("next", "reports"),
        ],
    )
    .await;
    assert_eq!(hidden.status(), 303);
    assert_eq!(
        hidden.headers()["location"].to_str().unwrap(),
        "/admin/reports?done=hidden"
    );
    // Gone from the queue at once, before the read model has the hide.
    let queue = page_text(app, &admin, "/admin/reports?done=hidden").await;
    assert!(queue.contains("作品已隐藏，它的举报已成立"));
    assert!(!queue.contains("山间小屋"), "{queue}");
    assert!(queue.contains("没有待处理的举报"));
    app.project().await;
    assert_eq!(statuses(app, &work).await, ["upheld", "upheld"]);
    let overview = page_text(app, &admin, "/admin").await;
    assert!(overview.contains(r#"data-testid="works-reported">0<"#));
}

/// A form posted as htmx posts it; the fragment answered.
async fn htmx(app: &TestApp, token: &str, path: &str, form: &[(&str, &str)]) -> String {
    let body = url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(form)
        .finish();
    crate::pages::htmx_form(&app.http, &app.address, token, path, &body)
        .await
        .text()
        .await
        .unwrap()
}
