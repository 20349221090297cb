//! The admins' queue of reported works: what was said of each, and the two ways out (hide the
//! work, which upholds its reports, or dismiss them).

use super::*;
use zhihui_domain::gallery::report::ReportReason;

#[derive(Debug, Deserialize)]
pub struct ReportsQuery {
    /// `hidden`: back from hiding a work of the queue.
    done: Option<String>,
    /// How many reports a dismissal just took off the queue.
    dismissed: Option<u64>,
}

/// `/admin/reports`.
pub async fn reports(
    page: Page,
    query: web::Query<ReportsQuery>,
) -> Result<HttpResponse, WebError> {
    page.admin()?;
    let works = page.state().gallery.reported_works().await?;
    let mut shown = Vec::with_capacity(works.len());
    for work in works {
        let reasons: Vec<Value> = work
            .reasons
            .iter()
            .map(|(reason, count)| {
                context! {
                    label => page.t(&format!("gallery.reason_{}", reason.as_str()), &[]),
                    count => *count,
                }
            })
            .collect();
        // The reason most given, as the creator will read it; "other" names nothing, so the
        // admin writes the rest.
        let hide_reason = match work.reasons.first() {
            Some((reason, _)) if *reason != ReportReason::Other => page.t(
                "admin.hide_reason_default",
                &[(
                    "reason",
                    page.t(&format!("gallery.reason_{}", reason.as_str()), &[]),
                )],
            ),
            _ => page.t("admin.hide_reason_plain", &[]),
        };
        let taken_down = work.status != "published";
        // As everyone sees it, labelled.
        let cover = work
            .cover
            .map(|image| crate::http::gallery::public_image_path(work.work_id, &image));
        shown.push(context! {
            id => work.work_id.to_string(),
            title => work.title,
            creator => work.creator.to_string(),
            creator_name => page.state().gallery.name_of(work.creator).await?.to_string(),
            taken_down,
            cover,
            reports => work.reports,
            reasons,
            notes => work.notes,
            first_reported_at => work.first_reported_at.to_rfc3339(),
            hide_reason,
        });
    }
    page.render(
        "admin/reports.html",
        context! {
            works => shown,
            hidden_now => query.done.as_deref() == Some("hidden"),
            dismissed_now => query.dismissed,
        },
    )
    .await
}

/// `POST /admin/reports/{id}/dismiss`: nothing wrong with the work; back to the queue.
pub async fn dismiss_reports(
    page: Page,
    path: web::Path<String>,
) -> Result<HttpResponse, WebError> {
    let admin = admin_of(&page)?;
    let work_id = Uuid::parse_str(&path)
        .map_err(|_| page.refusal(StatusCode::NOT_FOUND, "error.not_found"))?;
    let dismissed = page
        .state()
        .gallery
        .dismiss_reports(admin.0.user_id, work_id, &metadata(&page, &admin))
        .await
        .map_err(|error| page.unexpected(crate::http::gallery::gallery_error(error)))?;
    Ok(page.redirect(&format!("/admin/reports?dismissed={dismissed}")))
}
