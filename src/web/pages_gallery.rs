//! The gallery's pages: the public gallery (hot, new; the landing page of a visitor), a work, a
//! creator, and for a signed-in user their feed, their likes, their works and publishing. Likes
//! and follows are buttons in forms that htmx posts (with the session's CSRF token) and swaps in
//! place: no reload, and a keyboard's Enter presses them as any button. Every action calls the
//! gallery's own operation, as the API's handlers do; a refusal comes back in the reader's
//! words, beside the form, which keeps what was typed.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, web};
use minijinja::context;
use minijinja::value::Value;
use serde::Deserialize;
use uuid::Uuid;
use zhihui_domain::gallery::work::{WorkStatus, work_id_of_task};
use zhihui_domain::user::UserId;

use super::pages_user::metadata;
use super::render::{Page, WebError, encode_path};
use crate::gallery::reads::{Cursor, ListedWork, WorkPage};
use crate::gallery::{GalleryError, PublishRequest, WorkCard};
use crate::http::gallery::public_image_path;

/// Works per gallery page.
const PAGE: usize = 24;

fn work_context(card: &WorkCard, likes: u64, liked: Option<bool>) -> Value {
    context! {
        id => card.work_id.to_string(),
        title => card.title.clone(),
        creator => card.creator.to_string(),
        creator_name => card.creator_name.clone(),
        cover => card.images.first().map(|image| public_image_path(card.work_id, image)),
        images => card.images.iter().map(|image| public_image_path(card.work_id, image)).collect::<Vec<_>>(),
        width => card.settings.width,
        height => card.settings.height,
        likes,
        liked,
        published_at => card.published_at.to_rfc3339(),
    }
}

fn listed(works: &[ListedWork]) -> Vec<Value> {
    works
        .iter()
        .map(|work| work_context(&work.card, work.likes, work.liked_by_viewer))
        .collect()
}

fn viewer(page: &Page) -> Option<UserId> {
    page.member.as_ref().map(|member| member.session.user_id)
}

/// A refusal of the gallery in the reader's words.
fn message(page: &Page, error: GalleryError) -> Result<String, WebError> {
    Ok(match error {
        GalleryError::Invalid { field, .. } => page.t(&format!("gallery.invalid_{field}"), &[]),
        GalleryError::Unexpected(error) => return Err(WebError::from(error)),
        other => match crate::http::gallery::gallery_error(other) {
            // A work's `images` are the pictures chosen, not the generate form's count.
            crate::http::problem::ApiError::Validation { field, broken } if field == "images" => {
                page.field_message("work_images", &broken)
            }
            refused => page.message_of(&refused),
        },
    })
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    sort: Option<String>,
    cursor: Option<String>,
    /// `hidden`: the redirect after an admin hid a work (the page confirms it).
    done: Option<String>,
}

/// The query a page is redirected to after an action, so that it says the action was done.
#[derive(Debug, Deserialize)]
pub struct DoneQuery {
    done: Option<String>,
    /// The work the action was on.
    work: Option<String>,
    /// Where a list of one's own works goes on (the link to older works).
    cursor: Option<String>,
}

/// One's own works per page of `/gallery/mine`.
const MINE_PAGE: i64 = 50;

fn cursor_of(query: &ListQuery) -> Option<Cursor> {
    query.cursor.as_deref().and_then(Cursor::parse)
}

/// A grid of works and the link to the next page. An htmx request for the next page gets only
/// the cards and the next link, appended where the link was.
async fn grid(
    page: &Page,
    template: &str,
    title_key: &str,
    list: WorkPage,
    base: &str,
    extra: Value,
) -> Result<HttpResponse, WebError> {
    let separator = if base.contains('?') { '&' } else { '?' };
    let next = list
        .next
        .as_ref()
        .map(|cursor| format!("{base}{separator}cursor={cursor}"));
    let context = context! {
        works => listed(&list.works),
        next,
        title => page.t(title_key, &[]),
        ..extra
    };
    if page.is_htmx() && page.request.query_string().contains("cursor=") {
        return page.fragment("_work_grid.html", context);
    }
    page.render(template, context).await
}

/// `/gallery`: hot (default) or new.
pub async fn gallery(page: Page, query: web::Query<ListQuery>) -> Result<HttpResponse, WebError> {
    let sort = match query.sort.as_deref() {
        Some("new") => "new",
        _ => "hot",
    };
    let state = page.state();
    let list = if sort == "new" {
        state
            .gallery
            .newest(cursor_of(&query), PAGE, viewer(&page))
            .await?
    } else {
        state
            .gallery
            .hot(cursor_of(&query), PAGE, viewer(&page))
            .await?
    };
    let base = format!("/gallery?sort={sort}");
    grid(
        &page,
        "gallery.html",
        "gallery.title",
        list,
        &base,
        context! {
            sort,
            // Only an admin hides: nobody else is told a work was.
            hidden_now => query.done.as_deref() == Some("hidden") && page.admin().is_ok(),
        },
    )
    .await
}

/// `/gallery/feed`: the works of the creators the reader follows.
pub async fn feed(page: Page, query: web::Query<ListQuery>) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let list = page
        .state()
        .gallery
        .feed(user, cursor_of(&query), PAGE)
        .await?;
    grid(
        &page,
        "gallery.html",
        "gallery.feed",
        list,
        "/gallery/feed",
        context! { sort => "feed" },
    )
    .await
}

/// `/gallery/likes`: what the reader liked, latest first, a page at a time.
pub async fn likes(page: Page, query: web::Query<ListQuery>) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let before = query
        .cursor
        .as_deref()
        .and_then(crate::gallery::reads::parse_like_cursor);
    let (works, next) = page.state().gallery.liked_by(user, before, PAGE).await?;
    let list = WorkPage {
        works,
        next: next.map(crate::gallery::reads::render_like_cursor),
    };
    grid(
        &page,
        "gallery.html",
        "gallery.likes",
        list,
        "/gallery/likes",
        context! { sort => "likes" },
    )
    .await
}

/// `/gallery/mine`: the reader's works, whatever became of them.
pub async fn mine(page: Page, query: web::Query<DoneQuery>) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    // A cursor that is not one of ours reads as the first page, as the other lists do.
    let before = query
        .cursor
        .as_deref()
        .and_then(|cursor| crate::http::tasks::parse_time_cursor(cursor).ok());
    let (mut works, next_cursor) =
        crate::http::gallery::works_of(page.state(), user, before, MINE_PAGE).await?;
    // The work just acted on, as its stream has it: the list is a read model a moment behind.
    if let Some(work_id) = query
        .work
        .as_deref()
        .and_then(|raw| Uuid::parse_str(raw).ok())
        && let Some(row) = works.iter_mut().find(|row| row.work_id == work_id)
        && let Some((status, reason)) = page.state().gallery.own_work_status(user, work_id).await?
    {
        status.clone_into(&mut row.status);
        row.hidden_reason = reason;
    }
    page.render(
        "gallery_mine.html",
        context! {
            works => super::render::ser(&works),
            sort => "mine",
            next_cursor,
            first_page => before.is_none(),
            unpublished_now => query.done.as_deref() == Some("unpublished"),
        },
    )
    .await
}

fn not_found(page: &Page) -> WebError {
    page.refusal(StatusCode::NOT_FOUND, "error.not_found")
}

/// `/gallery/works/{id}`.
pub async fn work(
    page: Page,
    path: web::Path<String>,
    query: web::Query<DoneQuery>,
) -> Result<HttpResponse, WebError> {
    let work_id = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    work_page(&page, work_id, query.done.as_deref(), None).await
}

/// A report sent without JavaScript and refused: the work's page again, its report form open
/// with the refusal in it and the reader's choices kept.
struct RefusedReport<'a> {
    message: String,
    form: &'a ReportForm,
}

/// A work's page; `done` is the action it confirms.
async fn work_page(
    page: &Page,
    work_id: Uuid,
    done: Option<&str>,
    refused_report: Option<RefusedReport<'_>>,
) -> Result<HttpResponse, WebError> {
    let Some(view) = page.state().gallery.view(work_id, viewer(page)).await? else {
        return Err(not_found(page));
    };
    let card = &view.card;
    let own = viewer(page).is_some_and(|user| user.as_uuid() == card.creator);
    let refused = refused_report.is_some();
    let mut response = page
        .render(
            "work.html",
            context! {
                work => work_context(card, view.likes, view.liked_by_viewer),
                description => card.description.clone(),
                prompt => card.prompt.clone(),
                negative_prompt => card.negative_prompt.clone(),
                settings => super::render::ser(&card.settings),
                first_likers => view.first_likers.clone(),
                own,
                published_now => own && done == Some("published"),
                reported_now => done == Some("reported"),
                report_reasons => zhihui_domain::gallery::report::ReportReason::ALL
                    .iter()
                    .map(|reason| reason.as_str())
                    .collect::<Vec<_>>(),
                report_refused => refused_report.map(|refused| context! {
                    message => refused.message,
                    reason => refused.form.reason.clone(),
                    note => refused.form.note.clone(),
                }),
                next => encode_path(&format!("/gallery/works/{work_id}")),
            },
        )
        .await?;
    if refused {
        *response.status_mut() = StatusCode::UNPROCESSABLE_ENTITY;
    }
    Ok(response)
}

#[derive(Debug, Deserialize)]
pub struct LikeForm {
    /// `1`: like; `0`: take it back.
    like: String,
}

/// `POST /gallery/works/{id}/like`: the button again, pressed (htmx), or back to the work.
pub async fn like(
    page: Page,
    path: web::Path<String>,
    form: web::Form<LikeForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let work_id = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    let gallery = &page.state().gallery;
    let outcome = if form.like == "1" {
        gallery.like(user, work_id, &metadata(&page)?).await
    } else {
        gallery.unlike(user, work_id, &metadata(&page)?).await
    };
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            let text = message(&page, error)?;
            if page.is_htmx() {
                return page.alert(&format!("#like-{work_id}-messages"), "error", &text);
            }
            return Err(not_found(&page));
        }
    };
    if !page.is_htmx() {
        return Ok(page.redirect(&format!("/gallery/works/{work_id}")));
    }
    page.fragment(
        "_like_inner.html",
        context! { work => context! { id => work_id.to_string(), likes => outcome.likes, liked => Some(outcome.liked) } },
    )
}

/// `/gallery/creators/{id}`.
pub async fn creator(
    page: Page,
    path: web::Path<String>,
    query: web::Query<ListQuery>,
) -> Result<HttpResponse, WebError> {
    let creator = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    let creator = UserId::from_uuid(creator);
    let profile = match crate::http::gallery::creator_of(page.state(), viewer(&page), creator).await
    {
        Ok(profile) => profile,
        Err(crate::http::ApiError::NotFound(_)) => return Err(not_found(&page)),
        Err(error) => return Err(page.unexpected(error)),
    };
    let list = page
        .state()
        .gallery
        .creator_works(creator, cursor_of(&query), PAGE, viewer(&page))
        .await?;
    let own = viewer(&page) == Some(creator);
    grid(
        &page,
        "creator.html",
        "gallery.creator",
        list,
        &format!("/gallery/creators/{creator}"),
        context! { profile => super::render::ser(&profile), own, sort => "creator" },
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct FollowForm {
    /// `1`: follow; `0`: stop following.
    follow: String,
}

/// `POST /gallery/creators/{id}/follow`.
pub async fn follow(
    page: Page,
    path: web::Path<String>,
    form: web::Form<FollowForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let creator = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    let creator = UserId::from_uuid(creator);
    let gallery = &page.state().gallery;
    let outcome = if form.follow == "1" {
        gallery.follow(user, creator, &metadata(&page)?).await
    } else {
        gallery.unfollow(user, creator, &metadata(&page)?).await
    };
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            let text = message(&page, error)?;
            if page.is_htmx() {
                return page.alert("#follow-messages", "error", &text);
            }
            return Err(not_found(&page));
        }
    };
    if !page.is_htmx() {
        return Ok(page.redirect(&format!("/gallery/creators/{creator}")));
    }
    page.fragment(
        "_follow_inner.html",
        context! {
            profile => context! { creator => creator.to_string(), followers => outcome.followers, followed => Some(outcome.following) },
            oob => true,
        },
    )
}

#[derive(Debug, Deserialize)]
pub struct BlockForm {
    /// `1`: block; `0`: take it back.
    block: String,
}

/// `POST /gallery/creators/{id}/block`: then the creator's page again.
pub async fn block(
    page: Page,
    path: web::Path<String>,
    form: web::Form<BlockForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let creator = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    let creator = UserId::from_uuid(creator);
    let gallery = &page.state().gallery;
    let done = if form.block == "1" {
        gallery.block(user, creator, &metadata(&page)?).await
    } else {
        gallery.unblock(user, creator, &metadata(&page)?).await
    };
    match done {
        Ok(()) => Ok(page.redirect(&format!("/gallery/creators/{creator}"))),
        Err(error) => {
            let text = message(&page, error)?;
            page.alert("#follow-messages", "error", &text)
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct PublishQuery {
    task: String,
}

/// The task a publish form is for: the reader's own, succeeded, with its images.
async fn publish_context(page: &Page, task: &str) -> Result<Value, WebError> {
    let user = page.member()?.session.user_id;
    let task_id = Uuid::parse_str(task).map_err(|_| not_found(page))?;
    let view = match crate::http::tasks::task_view(page.state(), user, task_id).await {
        Ok(view) => view,
        Err(crate::http::problem::ApiError::NotFound(_)) => return Err(not_found(page)),
        // A store away is a 503 to try again, not "no such task".
        Err(error) => return Err(WebError::from(error)),
    };
    Ok(context! {
        task => super::render::ser(&view),
        title_max => zhihui_domain::gallery::work::TITLE_LENGTH_MAX,
        description_max => zhihui_domain::gallery::work::DESCRIPTION_LENGTH_MAX,
    })
}

/// `/gallery/publish?task=<id>`: the form.
pub async fn publish_page(
    page: Page,
    query: web::Query<PublishQuery>,
) -> Result<HttpResponse, WebError> {
    let context = publish_context(&page, &query.task).await?;
    let user = page.member()?.session.user_id;
    // Published before and taken down since: the form as it was then, to publish it again as
    // it was or changed.
    let earlier = match Uuid::parse_str(&query.task) {
        Ok(task) => page
            .state()
            .gallery
            .own_work(user, work_id_of_task(task))
            .await?
            .filter(|work| work.status == WorkStatus::Unpublished)
            .and_then(|work| work.last),
        Err(_) => None,
    };
    let form = match earlier {
        Some(last) => context! {
            title => last.title.as_str(),
            description => last.description.as_ref().map_or("", |text| text.as_str()),
            prompt_shown => last.prompt_shown,
            images => last.images,
            again => true,
        },
        None => context! { title => "", description => "", prompt_shown => false },
    };
    page.render("publish.html", context! { form, ..context })
        .await
}

#[derive(Debug, Deserialize)]
pub struct PublishForm {
    task: String,
    title: String,
    #[serde(default)]
    description: String,
    /// Present (`1`) when the prompt is shown.
    prompt_shown: Option<String>,
    /// The images chosen, in the order of the task (a repeated field).
    #[serde(default)]
    image: Vec<String>,
}

/// `POST /gallery/publish`: published, to the work's page; refused, the form again with what
/// the reader typed and why.
pub async fn publish(page: Page, body: web::Bytes) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    // `serde_urlencoded` has no repeated fields: read them by hand.
    let mut form = PublishForm {
        task: String::new(),
        title: String::new(),
        description: String::new(),
        prompt_shown: None,
        image: Vec::new(),
    };
    for (key, value) in url::form_urlencoded::parse(&body) {
        match &*key {
            "task" => form.task = value.into_owned(),
            "title" => form.title = value.into_owned(),
            "description" => form.description = value.into_owned(),
            "prompt_shown" => form.prompt_shown = Some(value.into_owned()),
            "image" => form.image.push(value.into_owned()),
            _ => {}
        }
    }
    let task_id = Uuid::parse_str(&form.task).map_err(|_| not_found(&page))?;
    // The API takes no images as "all of them"; in the form, unticking every one means none.
    if form.image.is_empty() {
        let text = message(
            &page,
            GalleryError::Work(zhihui_domain::gallery::work::WorkError::NoImages),
        )?;
        return page.alert("#publish-messages", "error", &text);
    }
    let published = page
        .state()
        .gallery
        .publish(
            user,
            PublishRequest {
                task_id,
                images: form.image.clone(),
                title: form.title.clone(),
                description: form.description.clone(),
                prompt_shown: form.prompt_shown.is_some(),
            },
            &metadata(&page)?,
        )
        .await;
    match published {
        Ok(work_id) => Ok(page.redirect(&format!("/gallery/works/{work_id}?done=published"))),
        Err(error) => {
            let text = message(&page, error)?;
            page.alert("#publish-messages", "error", &text)
        }
    }
}

/// `POST /gallery/works/{id}/unpublish` (its creator).
pub async fn unpublish(page: Page, path: web::Path<String>) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let work_id = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    match page
        .state()
        .gallery
        .unpublish(user, work_id, &metadata(&page)?)
        .await
    {
        Ok(()) => Ok(page.redirect(&format!("/gallery/mine?done=unpublished&work={work_id}"))),
        Err(GalleryError::Unexpected(error)) => Err(WebError::from(error)),
        Err(_) => Err(not_found(&page)),
    }
}

#[derive(Debug, Deserialize)]
pub struct ReportForm {
    /// Absent when no reason was chosen (a form sent without the browser's own check).
    reason: Option<String>,
    #[serde(default)]
    note: String,
}

/// `POST /gallery/works/{id}/report`: the answer in the form's message area (htmx), or back to
/// the work saying it was received.
pub async fn report(
    page: Page,
    path: web::Path<String>,
    form: web::Form<ReportForm>,
) -> Result<HttpResponse, WebError> {
    let user = page.member()?.session.user_id;
    let work_id = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    let reported =
        match crate::http::gallery::paced(page.state(), user, crate::http::gallery::Pace::Reports)
            .await
        {
            Err(refused) => Err(page.message_of(&refused)),
            Ok(()) => match page
                .state()
                .gallery
                .report(
                    user,
                    work_id,
                    form.reason.as_deref().unwrap_or_default(),
                    &form.note,
                    &metadata(&page)?,
                )
                .await
            {
                Ok(()) => Ok(()),
                Err(GalleryError::Invalid {
                    field: "reason", ..
                }) => Err(page.t("gallery.report_pick_reason", &[])),
                Err(GalleryError::Invalid { field, broken }) => {
                    Err(page.field_message(field, &broken))
                }
                Err(error) => Err(message(&page, error)?),
            },
        };
    match reported {
        Ok(()) if page.is_htmx() => page.alert(
            "#report-messages",
            "success",
            &page.t("gallery.reported", &[]),
        ),
        Ok(()) => Ok(page.redirect(&format!("/gallery/works/{work_id}?done=reported"))),
        Err(text) if page.is_htmx() => page.alert("#report-messages", "error", &text),
        Err(message) => {
            let refused = RefusedReport {
                message,
                form: &form,
            };
            work_page(&page, work_id, None, Some(refused)).await
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct HideForm {
    reason: String,
    /// `reports`: the admin hid it from the reports' queue, and goes back there.
    next: Option<String>,
}

/// `POST /gallery/works/{id}/hide` (an admin).
pub async fn hide(
    page: Page,
    path: web::Path<String>,
    form: web::Form<HideForm>,
) -> Result<HttpResponse, WebError> {
    let admin = page.admin()?.session.user_id;
    let work_id = Uuid::parse_str(&path).map_err(|_| not_found(&page))?;
    match page
        .state()
        .gallery
        .hide(admin, work_id, &form.reason, &metadata(&page)?)
        .await
    {
        Ok(()) if form.next.as_deref() == Some("reports") => {
            Ok(page.redirect("/admin/reports?done=hidden"))
        }
        Ok(()) => Ok(page.redirect("/gallery?sort=new&done=hidden")),
        Err(error) => {
            let text = message(&page, error)?;
            if page.is_htmx() {
                return page.alert("#hide-messages", "error", &text);
            }
            Err(page.refusal(StatusCode::UNPROCESSABLE_ENTITY, "gallery.invalid_reason"))
        }
    }
}
