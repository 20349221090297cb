//! The creators' gallery (`/api/v1/gallery/...`): the public lists, works, creators and images
//! anyone may read without logging in; publishing, likes, follows, the feed and one's likes for a
//! logged-in user (an API key needs `gallery:write` to change anything); hiding for admins.

use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::gallery::block::BlockError;
use zhihui_domain::gallery::follow::FollowError;
use zhihui_domain::gallery::like::LikeError;
use zhihui_domain::gallery::report::ReportError;
use zhihui_domain::gallery::work::WorkError;
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::text::echoed;
use zhihui_domain::user::UserId;

use crate::gallery::reads::{Cursor, ListedWork, PAGE_MAX, WorkPage};
use crate::gallery::{GalleryError, PublishRequest, WorkCard, WorkView};
use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::identity::admission::Admission;
use crate::state::AppState;

/// The caller if it presented credentials, else a visitor. A bearer token that fails is an
/// error (a program wants to know); a browser's stale cookie is a visitor.
#[derive(Debug)]
pub struct Viewer(pub Option<crate::identity::sessions::Session>);

impl actix_web::FromRequest for Viewer {
    type Error = ApiError;
    type Future = futures::future::LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, _payload: &mut actix_web::dev::Payload) -> Self::Future {
        let request = request.clone();
        Box::pin(async move {
            let bearer = request
                .headers()
                .contains_key(actix_web::http::header::AUTHORIZATION);
            let cookie = request
                .cookie(crate::http::cookie::SESSION_COOKIE)
                .is_some();
            if !bearer && !cookie {
                return Ok(Viewer(None));
            }
            match crate::http::extract::authenticate(request).await {
                // A key without `gallery:write` reads the public gallery as a visitor: what its
                // owner liked, follows or blocked is that scope's to read, not every key's.
                Ok(session)
                    if session.key.as_ref().is_some_and(|grant| {
                        !grant.allows(zhihui_domain::api_key::Scope::GalleryWrite)
                    }) =>
                {
                    Ok(Viewer(None))
                }
                Ok(session) => Ok(Viewer(Some(session))),
                Err(error) if bearer => Err(error),
                Err(_) => Ok(Viewer(None)),
            }
        })
    }
}

impl Viewer {
    pub fn user_id(&self) -> Option<UserId> {
        self.0.as_ref().map(|session| session.user_id)
    }
}

/// The answer of a refused gallery operation; each names its rule.
pub fn gallery_error(error: GalleryError) -> ApiError {
    let refused = |status, rule: &'static str, detail: String| ApiError::Refused {
        status,
        rule,
        detail,
        window: None,
    };
    use actix_web::http::StatusCode;
    match error {
        GalleryError::Invalid { field, broken } => ApiError::invalid(field, broken),
        GalleryError::NoSuchTask => ApiError::NotFound("no such task".into()),
        GalleryError::Work(WorkError::NoSuchWork) | GalleryError::Like(LikeError::NoSuchWork) => {
            ApiError::NotFound("no such work".into())
        }
        GalleryError::Work(WorkError::NotYourTask) => ApiError::NotFound("no such task".into()),
        GalleryError::Work(rule @ WorkError::TaskNotSucceeded) => {
            refused(StatusCode::CONFLICT, "task-not-succeeded", rule.to_string())
        }
        GalleryError::Work(WorkError::NoImages) => {
            ApiError::invalid_by("images", Rule::WorkNoImages)
        }
        GalleryError::Work(WorkError::TooManyImages) => ApiError::invalid(
            "images",
            Broken::new(Rule::WorkTooManyImages)
                .with("max", zhihui_domain::gallery::work::WORK_IMAGES_MAX),
        ),
        GalleryError::Work(WorkError::UnknownImage(image)) => ApiError::invalid(
            "images",
            Broken::new(Rule::WorkUnknownImage).with("image", echoed(&image)),
        ),
        GalleryError::Work(WorkError::ImageTwice(image)) => ApiError::invalid(
            "images",
            Broken::new(Rule::WorkImageTwice).with("image", echoed(&image)),
        ),
        GalleryError::Work(rule @ WorkError::AlreadyPublished) => {
            refused(StatusCode::CONFLICT, "already-published", rule.to_string())
        }
        GalleryError::Work(rule @ WorkError::HiddenByAdmin { .. }) => {
            refused(StatusCode::CONFLICT, "hidden-by-admin", rule.to_string())
        }
        GalleryError::Follow(rule @ FollowError::FollowingOneself) => refused(
            StatusCode::UNPROCESSABLE_ENTITY,
            "following-oneself",
            rule.to_string(),
        ),
        GalleryError::Follow(rule @ FollowError::CreatorBlocked) => {
            refused(StatusCode::CONFLICT, "creator-blocked", rule.to_string())
        }
        GalleryError::Follow(FollowError::NoSuchCreator)
        | GalleryError::Block(BlockError::NoSuchCreator) => {
            ApiError::NotFound("no such creator".into())
        }
        GalleryError::Block(rule @ BlockError::BlockingOneself) => refused(
            StatusCode::UNPROCESSABLE_ENTITY,
            "blocking-oneself",
            rule.to_string(),
        ),
        GalleryError::Report(ReportError::NoSuchWork) => ApiError::NotFound("no such work".into()),
        GalleryError::Report(rule @ ReportError::OwnWork) => refused(
            StatusCode::UNPROCESSABLE_ENTITY,
            "reporting-own-work",
            rule.to_string(),
        ),
        GalleryError::Report(ReportError::NoteRequired) => {
            ApiError::invalid_by("note", Rule::ReportNoteRequired)
        }
        GalleryError::Report(rule @ ReportError::AlreadyReported) => {
            refused(StatusCode::CONFLICT, "already-reported", rule.to_string())
        }
        GalleryError::Unexpected(error) => ApiError::from(error),
    }
}

fn parse_id(text: &str, what: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(text).map_err(|_| ApiError::NotFound(format!("no such {what}")))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct PageQuery {
    /// Where the page starts: the `next` of the page before.
    #[param(
        pattern = "^(-?[0-9]{1,20}(\\.[0-9]{1,64})?:(100000|[0-9]{1,5})|[0-9]{1,17}:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$"
    )]
    pub cursor: Option<String>,
    /// Works per page, 1 to 48 (24 when absent).
    #[param(minimum = 1, maximum = 48)]
    pub limit: Option<usize>,
}

impl PageQuery {
    fn cursor(&self) -> Result<Option<Cursor>, ApiError> {
        match &self.cursor {
            None => Ok(None),
            Some(text) => Cursor::parse(text)
                .map(Some)
                .ok_or_else(|| ApiError::invalid_by("cursor", Rule::NextOfEarlierPage)),
        }
    }

    fn limit(&self) -> Result<usize, ApiError> {
        match self.limit {
            None => Ok(24),
            Some(limit) if (1..=PAGE_MAX).contains(&limit) => Ok(limit),
            Some(_) => Err(ApiError::invalid(
                "limit",
                Broken::new(Rule::Between)
                    .with("min", 1)
                    .with("max", PAGE_MAX),
            )),
        }
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkSettingsResponse {
    pub model: String,
    pub width: u32,
    pub height: u32,
    pub steps: u32,
    pub cfg: String,
    pub sampler: String,
    pub scheduler: String,
}

/// A published work. `prompt` and `negative_prompt` are absent when its creator hid them.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkResponse {
    pub work_id: Uuid,
    pub creator: Uuid,
    pub creator_name: String,
    pub title: String,
    pub description: Option<String>,
    /// Public image addresses, in the creator's order.
    pub images: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    pub settings: WorkSettingsResponse,
    pub published_at: DateTime<Utc>,
    pub likes: u64,
    /// The earliest likers' names (five at most), first first; only on a work's own answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_likers: Option<Vec<String>>,
    /// Whether the caller likes it (absent for a visitor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub liked: Option<bool>,
}

/// Where a work's image is served to anyone.
pub fn public_image_path(work_id: Uuid, image: &str) -> String {
    format!("/api/v1/gallery/works/{work_id}/images/{image}")
}

pub fn work_response(
    card: &WorkCard,
    likes: u64,
    first_likers: Option<Vec<String>>,
    liked: Option<bool>,
) -> WorkResponse {
    WorkResponse {
        work_id: card.work_id,
        creator: card.creator,
        creator_name: card.creator_name.clone(),
        title: card.title.clone(),
        description: card.description.clone(),
        images: card
            .images
            .iter()
            .map(|image| public_image_path(card.work_id, image))
            .collect(),
        prompt: card.prompt.clone(),
        negative_prompt: card.negative_prompt.clone(),
        settings: WorkSettingsResponse {
            model: card.settings.model.clone(),
            width: card.settings.width,
            height: card.settings.height,
            steps: card.settings.steps,
            cfg: card.settings.cfg.clone(),
            sampler: card.settings.sampler.clone(),
            scheduler: card.settings.scheduler.clone(),
        },
        published_at: card.published_at,
        likes,
        first_likers,
        liked,
    }
}

fn view_response(view: &WorkView) -> WorkResponse {
    work_response(
        &view.card,
        view.likes,
        Some(view.first_likers.clone()),
        view.liked_by_viewer,
    )
}

fn listed_response(work: &ListedWork) -> WorkResponse {
    work_response(&work.card, work.likes, None, work.liked_by_viewer)
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkPageResponse {
    pub works: Vec<WorkResponse>,
    /// The next page's cursor; absent at the end.
    pub next: Option<String>,
}

fn page_response(page: &WorkPage) -> WorkPageResponse {
    WorkPageResponse {
        works: page.works.iter().map(listed_response).collect(),
        next: page.next.clone(),
    }
}

/// Public answers: shared caches may keep them a moment (a hidden work is gone from ours at once;
/// a shared cache keeps it at most this long).
fn public_json<T: Serialize>(body: &T) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header(("Cache-Control", "public, max-age=1"))
        .json(body)
}

fn personal_json<T: Serialize>(viewer: &Viewer, body: &T) -> HttpResponse {
    if viewer.0.is_some() {
        HttpResponse::Ok().json(body)
    } else {
        public_json(body)
    }
}

/// The hot list: likes weighed by age.
#[utoipa::path(
    get, operation_id = "gallery_hot", path = "/api/v1/gallery/hot", tag = "gallery", params(PageQuery),
    responses((status = 200, body = WorkPageResponse), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn hot(
    state: web::Data<AppState>,
    viewer: Viewer,
    query: crate::http::extract::Query<PageQuery>,
) -> Result<HttpResponse, ApiError> {
    let page = state
        .gallery
        .hot(query.cursor()?, query.limit()?, viewer.user_id())
        .await?;
    Ok(personal_json(&viewer, &page_response(&page)))
}

/// The new list: newest first.
#[utoipa::path(
    get, operation_id = "gallery_newest", path = "/api/v1/gallery/new", tag = "gallery", params(PageQuery),
    responses((status = 200, body = WorkPageResponse), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn newest(
    state: web::Data<AppState>,
    viewer: Viewer,
    query: crate::http::extract::Query<PageQuery>,
) -> Result<HttpResponse, ApiError> {
    let page = state
        .gallery
        .newest(query.cursor()?, query.limit()?, viewer.user_id())
        .await?;
    Ok(personal_json(&viewer, &page_response(&page)))
}

/// One published work.
#[utoipa::path(
    get, operation_id = "gallery_work", path = "/api/v1/gallery/works/{id}", tag = "gallery",
    responses((status = 200, body = WorkResponse), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn work(
    state: web::Data<AppState>,
    viewer: Viewer,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let work_id = parse_id(&path, "work")?;
    let view = state
        .gallery
        .view(work_id, viewer.user_id())
        .await?
        .ok_or_else(|| ApiError::NotFound("no such work".into()))?;
    Ok(personal_json(&viewer, &view_response(&view)))
}

/// An image of a published work, to anyone. The stored copy carries the visible mark and the
/// AIGC metadata and nothing of the prompt.
#[utoipa::path(
    get, operation_id = "gallery_image", path = "/api/v1/gallery/works/{id}/images/{image}", tag = "gallery",
    responses(
        (status = 200, description = "the work's image as its creator's own route serves it: labelled as AI-generated (the visible mark and the AIGC metadata; `X-AIGC-Label: 1`), without ComfyUI's prompt and workflow; a strong `ETag` and `Cache-Control: public, no-cache` (a work taken down stops being served at once)", content_type = "image/png"),
        (status = 304, description = "`If-None-Match` names the image's `ETag`"),
        (status = 404, description = "no such work, not visible, or not one of its images", body = crate::http::problem::Problem),
    )
)]
pub async fn image(
    state: web::Data<AppState>,
    request: HttpRequest,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let not_found = || ApiError::NotFound("no such image".into());
    let (work, image) = path.into_inner();
    let work_id = parse_id(&work, "image")?;
    let card = state.gallery.card(work_id).await?.ok_or_else(not_found)?;
    if !card.images.contains(&image) {
        return Err(not_found());
    }
    let image_id = Uuid::parse_str(&image).map_err(|_| not_found())?;
    let Some((record, bytes)) = state.images.get(image_id).await? else {
        return Err(not_found());
    };
    // ComfyUI's workflow (prompts included) never leaves in a public copy, whatever the
    // stored file kept for its owner.
    let stripped = match crate::labels::public_copy(&bytes) {
        std::borrow::Cow::Owned(public) => Some(public),
        std::borrow::Cow::Borrowed(_) => None,
    };
    let etag = match &stripped {
        None => format!("\"{}\"", record.sha256),
        Some(_) => format!("\"{}-public\"", record.sha256),
    };
    let matches = request
        .headers()
        .get(actix_web::http::header::IF_NONE_MATCH)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.split(',').any(|tag| tag.trim() == etag));
    let mut response = if matches {
        HttpResponse::NotModified()
    } else {
        HttpResponse::Ok()
    };
    response
        .insert_header((actix_web::http::header::ETAG, etag))
        // Revalidated on every use: a work hidden or unpublished stops being served at once.
        .insert_header(("Cache-Control", "public, no-cache"))
        .insert_header(("X-Content-Type-Options", "nosniff"))
        .insert_header(("X-AIGC-Label", "1"))
        .insert_header(actix_web::http::header::ContentEncoding::Identity);
    if matches {
        return Ok(response.finish());
    }
    Ok(response
        .content_type(record.content_type.as_str())
        .body(stripped.unwrap_or(bytes)))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CreatorResponse {
    pub creator: Uuid,
    /// The display name they chose, else the handle.
    pub name: String,
    /// The username, or `user#` and ten hex digits for a user without one (until they set a
    /// username; then it stays): tells apart creators who chose the same display name.
    pub handle: String,
    pub followers: u64,
    pub following: u64,
    /// Whether the caller follows them (absent for a visitor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub followed: Option<bool>,
    /// The people both the caller and the creator follow (absent for a visitor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub common_follows: Option<Vec<NamedUser>>,
    /// Whether the caller blocked them (absent for a visitor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocked: Option<bool>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct NamedUser {
    pub id: Uuid,
    pub name: String,
}

/// A creator: counts, and for a logged-in caller whether they follow them and whom both follow.
pub async fn creator_of(
    state: &AppState,
    viewer: Option<UserId>,
    creator: UserId,
) -> Result<CreatorResponse, ApiError> {
    let known = state.gallery.user_exists(creator).await?;
    if !known {
        return Err(ApiError::NotFound("no such creator".into()));
    }
    let (followers, following) = state.gallery.follow_counts(creator).await?;
    let blocked = match viewer {
        Some(viewer) => Some(
            state
                .gallery
                .blocked_by(viewer)
                .await?
                .contains(&creator.as_uuid()),
        ),
        None => None,
    };
    let (followed, common_follows) = match viewer {
        Some(viewer) => (
            Some(state.gallery.follows(viewer, creator).await?),
            Some(
                state
                    .gallery
                    .common_follows(viewer, creator)
                    .await?
                    .into_iter()
                    .map(|(id, name)| NamedUser { id, name })
                    .collect(),
            ),
        ),
        None => (None, None),
    };
    Ok(CreatorResponse {
        creator: creator.as_uuid(),
        name: state.gallery.name_of(creator.as_uuid()).await?.to_string(),
        handle: state
            .gallery
            .handle_of(creator.as_uuid())
            .await?
            .to_string(),
        followers,
        following,
        followed,
        common_follows,
        blocked,
    })
}

/// A creator's profile.
#[utoipa::path(
    get, operation_id = "gallery_creator", path = "/api/v1/gallery/creators/{id}", tag = "gallery",
    responses((status = 200, body = CreatorResponse), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn creator(
    state: web::Data<AppState>,
    viewer: Viewer,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let creator = UserId::from_uuid(parse_id(&path, "creator")?);
    let body = creator_of(&state, viewer.user_id(), creator).await?;
    Ok(personal_json(&viewer, &body))
}

/// A creator's works, newest first.
#[utoipa::path(
    get, operation_id = "gallery_creator_works", path = "/api/v1/gallery/creators/{id}/works", tag = "gallery", params(PageQuery),
    responses((status = 200, body = WorkPageResponse), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn creator_works(
    state: web::Data<AppState>,
    viewer: Viewer,
    path: web::Path<String>,
    query: crate::http::extract::Query<PageQuery>,
) -> Result<HttpResponse, ApiError> {
    let creator = UserId::from_uuid(parse_id(&path, "creator")?);
    if !state.gallery.user_exists(creator).await? {
        return Err(ApiError::NotFound("no such creator".into()));
    }
    let page = state
        .gallery
        .creator_works(creator, query.cursor()?, query.limit()?, viewer.user_id())
        .await?;
    Ok(personal_json(&viewer, &page_response(&page)))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishBody {
    pub task_id: Uuid,
    /// Image ids of the task, in the order to show; all of them when absent or empty.
    #[serde(default)]
    pub images: Vec<String>,
    /// One line, up to 60 characters.
    #[schema(min_length = 1, max_length = 60)]
    pub title: String,
    /// Up to 1,000 characters.
    #[serde(default)]
    #[schema(max_length = 1000)]
    pub description: String,
    /// Whether others see the prompt and the negative prompt.
    pub prompt_shown: bool,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PublishedResponse {
    pub work_id: Uuid,
}

/// Publish images of one of the caller's tasks that succeeded (sent again: the same work).
#[utoipa::path(
    post, operation_id = "gallery_publish", path = "/api/v1/gallery/works", tag = "gallery", security(("bearer" = [])),
    request_body = PublishBody,
    responses(
        (status = 201, body = PublishedResponse),
        (status = 404, description = "no such task of the caller's", body = crate::http::problem::Problem),
        (status = 409, description = "`task-not-succeeded`, `already-published`, `hidden-by-admin`", body = crate::http::problem::Problem),
        (status = 422, body = crate::http::problem::Problem),
    )
)]
pub async fn publish(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<PublishBody>,
) -> Result<HttpResponse, ApiError> {
    let body = body.into_inner();
    let work_id = state
        .gallery
        .publish(
            caller.user_id(),
            PublishRequest {
                task_id: body.task_id,
                images: body.images,
                title: body.title,
                description: body.description,
                prompt_shown: body.prompt_shown,
            },
            &event_metadata(&request, caller.actor()),
        )
        .await
        .map_err(gallery_error)?;
    Ok(HttpResponse::Created().json(PublishedResponse { work_id }))
}

/// Take one of the caller's works down.
#[utoipa::path(
    post, operation_id = "gallery_unpublish", path = "/api/v1/gallery/works/{id}/unpublish", tag = "gallery", security(("bearer" = [])),
    responses((status = 204), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn unpublish(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let work_id = parse_id(&path, "work")?;
    state
        .gallery
        .unpublish(
            caller.user_id(),
            work_id,
            &event_metadata(&request, caller.actor()),
        )
        .await
        .map_err(gallery_error)?;
    Ok(HttpResponse::NoContent().finish())
}

/// What a user may do so many times in a window, and the rule a refusal names.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pace {
    Likes,
    Follows,
    Reports,
}

/// One more of `pace` by `user`, if their window has room (the web app's forms are paced alike).
pub(crate) async fn paced(state: &AppState, user: UserId, pace: Pace) -> Result<(), ApiError> {
    let settings = state.gallery.settings();
    let (what, rule, most, window, per) = match pace {
        Pace::Likes => (
            "like",
            "too-many-likes",
            settings.likes_per_minute,
            60,
            "a minute",
        ),
        Pace::Follows => (
            "follow",
            "too-many-follows",
            settings.follows_per_minute,
            60,
            "a minute",
        ),
        Pace::Reports => (
            "report",
            "too-many-reports",
            settings.reports_per_hour,
            3600,
            "an hour",
        ),
    };
    let scope = format!("gallery:{what}:{user}");
    match state
        .limits
        .admit(&scope, most, std::time::Duration::from_secs(window))
        .await?
    {
        Admission::Admitted => Ok(()),
        Admission::Full { retry_at } => Err(ApiError::TooManyRequests {
            rule,
            detail: format!("at most {most} {per}; try again at {retry_at}"),
            retry_at,
            retry_after_s: crate::http::retry_after(&state.clock, retry_at),
        }),
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LikeResponse {
    pub liked: bool,
    pub likes: u64,
}

/// Like a work (once: repeating it changes nothing).
#[utoipa::path(
    put, operation_id = "gallery_like", path = "/api/v1/gallery/works/{id}/like", tag = "gallery", security(("bearer" = [])),
    responses((status = 200, body = LikeResponse), (status = 404, body = crate::http::problem::Problem), (status = 429, body = crate::http::problem::Problem))
)]
pub async fn like(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    like_answer(&state, &request, &caller, &path, true).await
}

/// Take a like back.
#[utoipa::path(
    delete, operation_id = "gallery_unlike", path = "/api/v1/gallery/works/{id}/like", tag = "gallery", security(("bearer" = [])),
    responses((status = 200, body = LikeResponse), (status = 404, description = "not a work's id", body = crate::http::problem::Problem), (status = 429, body = crate::http::problem::Problem))
)]
pub async fn unlike(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    like_answer(&state, &request, &caller, &path, false).await
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct FollowResponse {
    pub following: bool,
    pub followers: u64,
}

/// Follow a creator.
#[utoipa::path(
    put, operation_id = "gallery_follow", path = "/api/v1/gallery/creators/{id}/follow", tag = "gallery", security(("bearer" = [])),
    responses((status = 200, body = FollowResponse), (status = 404, body = crate::http::problem::Problem), (status = 409, description = "`creator-blocked`", body = crate::http::problem::Problem), (status = 422, description = "`following-oneself`", body = crate::http::problem::Problem))
)]
pub async fn follow(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    follow_answer(&state, &request, &caller, &path, true).await
}

/// Stop following a creator.
#[utoipa::path(
    delete, operation_id = "gallery_unfollow", path = "/api/v1/gallery/creators/{id}/follow", tag = "gallery", security(("bearer" = [])),
    responses((status = 200, body = FollowResponse), (status = 404, description = "not a user's id", body = crate::http::problem::Problem), (status = 429, body = crate::http::problem::Problem))
)]
pub async fn unfollow(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    follow_answer(&state, &request, &caller, &path, false).await
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BlockResponse {
    pub blocked: bool,
}

/// Block a creator: their works leave the caller's lists and feed (and the caller stops
/// following them).
#[utoipa::path(
    put, operation_id = "gallery_block", path = "/api/v1/gallery/creators/{id}/block", tag = "gallery", security(("bearer" = [])),
    responses((status = 200, body = BlockResponse), (status = 404, body = crate::http::problem::Problem), (status = 422, description = "`blocking-oneself`", body = crate::http::problem::Problem), (status = 429, body = crate::http::problem::Problem))
)]
pub async fn block(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    block_answer(&state, &request, &caller, &path, true).await
}

/// Take a block back.
#[utoipa::path(
    delete, operation_id = "gallery_unblock", path = "/api/v1/gallery/creators/{id}/block", tag = "gallery", security(("bearer" = [])),
    responses((status = 200, body = BlockResponse), (status = 404, description = "not a user's id", body = crate::http::problem::Problem), (status = 429, body = crate::http::problem::Problem))
)]
pub async fn unblock(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    block_answer(&state, &request, &caller, &path, false).await
}

/// The caller's feed: new works of the creators they follow, newest first.
#[utoipa::path(
    get, operation_id = "gallery_feed", path = "/api/v1/gallery/feed", tag = "gallery", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = WorkPageResponse), (status = 401, body = crate::http::problem::Problem))
)]
pub async fn feed(
    state: web::Data<AppState>,
    caller: Authenticated,
    query: crate::http::extract::Query<PageQuery>,
) -> Result<HttpResponse, ApiError> {
    let page = state
        .gallery
        .feed(caller.user_id(), query.cursor()?, query.limit()?)
        .await?;
    Ok(HttpResponse::Ok().json(page_response(&page)))
}

/// The works the caller liked, latest like first.
#[utoipa::path(
    get, operation_id = "gallery_my_likes", path = "/api/v1/gallery/likes", tag = "gallery", security(("bearer" = [])), params(PageQuery),
    responses((status = 200, body = WorkPageResponse), (status = 401, body = crate::http::problem::Problem))
)]
pub async fn my_likes(
    state: web::Data<AppState>,
    caller: Authenticated,
    query: crate::http::extract::Query<PageQuery>,
) -> Result<HttpResponse, ApiError> {
    let before = match &query.cursor {
        None => None,
        Some(text) => Some(
            crate::gallery::reads::parse_like_cursor(text)
                .ok_or_else(|| ApiError::invalid_by("cursor", Rule::NextOfEarlierPage))?,
        ),
    };
    let (works, next) = state
        .gallery
        .liked_by(caller.user_id(), before, query.limit()?)
        .await?;
    Ok(HttpResponse::Ok().json(WorkPageResponse {
        works: works.iter().map(listed_response).collect(),
        next: next.map(crate::gallery::reads::render_like_cursor),
    }))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MyWorkResponse {
    pub work_id: Uuid,
    pub task_id: Uuid,
    pub title: String,
    /// `published`, `unpublished` or `hidden`.
    pub status: String,
    /// Why an admin hid it, while it is hidden.
    pub hidden_reason: Option<String>,
    pub published_at: DateTime<Utc>,
    pub likes: i64,
    /// Its first image, for its owner whatever became of the work (`GET /api/v1/images/{id}`).
    pub cover: Option<String>,
}

/// How many of one's own works a page lists at most (and when no `limit` is given).
pub const MY_WORKS_PAGE_MAX: i64 = 200;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct MyWorksQuery {
    /// 1 to 200, default 200.
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<i64>,
    /// From the `Link` header (`rel="next"`) of the page before.
    #[param(
        pattern = "^[0-9]{1,17}_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
    )]
    pub cursor: Option<String>,
}

/// The caller's works, whatever became of them (hidden ones with the admin's reason), newest
/// first. A list longer than the page goes on where the `Link` header's `rel="next"` points.
#[utoipa::path(
    get, operation_id = "gallery_my_works", path = "/api/v1/me/works", tag = "gallery", security(("bearer" = [])),
    params(MyWorksQuery),
    responses(
        (status = 200, body = [MyWorkResponse], headers(("Link" = String, description = "`<...>; rel=\"next\"` while older works remain"))),
        (status = 401, body = crate::http::problem::Problem),
        (status = 422, body = crate::http::problem::Problem),
    )
)]
pub async fn my_works(
    state: web::Data<AppState>,
    caller: Authenticated,
    query: crate::http::extract::Query<MyWorksQuery>,
) -> Result<HttpResponse, ApiError> {
    let limit = query.limit.unwrap_or(MY_WORKS_PAGE_MAX);
    if !(1..=MY_WORKS_PAGE_MAX).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            Broken::new(Rule::Between)
                .with("min", 1)
                .with("max", MY_WORKS_PAGE_MAX),
        ));
    }
    let before = query
        .cursor
        .as_deref()
        .map(crate::http::tasks::parse_time_cursor)
        .transpose()?;
    let (works, next) = works_of(&state, caller.user_id(), before, limit).await?;
    let mut response = HttpResponse::Ok();
    if let Some(next) = next {
        response.insert_header((
            actix_web::http::header::LINK,
            format!("</api/v1/me/works?limit={limit}&cursor={next}>; rel=\"next\""),
        ));
    }
    Ok(response.json(works))
}

/// A page of a creator's own works, newest first, older than `before` (a cursor's time and id);
/// and the cursor of the page after it, when there is one.
pub async fn works_of(
    state: &AppState,
    user: UserId,
    before: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> anyhow::Result<(Vec<MyWorkResponse>, Option<String>)> {
    let (before_at, before_id) = before.unwrap_or((DateTime::<Utc>::MAX_UTC, Uuid::max()));
    let client = state.pg_pool.get().await?;
    // Served by `works_by_creator` (creator, published_at DESC, work_id DESC): a page reads only
    // its own rows, however many works came before.
    let rows = client
        .query(
            "SELECT work_id, task_id, title, status, hidden_reason, published_at, like_count,
                    images[1]
               FROM works WHERE creator = $1 AND (published_at, work_id) < ($2, $3)
              ORDER BY published_at DESC, work_id DESC LIMIT $4",
            &[&user.as_uuid(), &before_at, &before_id, &(limit + 1)],
        )
        .await?;
    let mut works: Vec<MyWorkResponse> = rows
        .iter()
        .map(|row| MyWorkResponse {
            work_id: row.get(0),
            task_id: row.get(1),
            title: row.get(2),
            status: row.get(3),
            hidden_reason: row.get(4),
            published_at: row.get(5),
            likes: row.get(6),
            cover: row
                .get::<_, Option<String>>(7)
                .map(|image| format!("/api/v1/images/{image}")),
        })
        .collect();
    let more = works.len() as i64 > limit;
    works.truncate(usize::try_from(limit).unwrap_or(0));
    let next = works
        .last()
        .filter(|_| more)
        .map(|last| crate::http::tasks::time_cursor(last.published_at, last.work_id));
    Ok((works, next))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HideBody {
    /// Why (one line, up to 200 characters): the creator sees it, the audit log keeps it.
    pub reason: String,
}

/// Hide a work from everyone but its creator.
#[utoipa::path(
    post, operation_id = "gallery_hide", path = "/api/v1/admin/gallery/works/{id}/hide", tag = "admin", security(("bearer" = [])),
    request_body = HideBody,
    responses((status = 204), (status = 404, body = crate::http::problem::Problem), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn hide(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
    body: crate::http::extract::Json<HideBody>,
) -> Result<HttpResponse, ApiError> {
    let work_id = parse_id(&path, "work")?;
    state
        .gallery
        .hide(
            admin.0.user_id,
            work_id,
            &body.reason,
            &event_metadata(&request, admin.actor()),
        )
        .await
        .map_err(gallery_error)?;
    Ok(HttpResponse::NoContent().finish())
}

/// A like given (`true`) or taken back, paced per user.
async fn like_answer(
    state: &AppState,
    request: &HttpRequest,
    caller: &Authenticated,
    path: &str,
    like: bool,
) -> Result<HttpResponse, ApiError> {
    let work_id = parse_id(path, "work")?;
    paced(state, caller.user_id(), Pace::Likes).await?;
    let metadata = event_metadata(request, caller.actor());
    let done = if like {
        state
            .gallery
            .like(caller.user_id(), work_id, &metadata)
            .await
    } else {
        state
            .gallery
            .unlike(caller.user_id(), work_id, &metadata)
            .await
    }
    .map_err(gallery_error)?;
    Ok(HttpResponse::Ok().json(LikeResponse {
        liked: done.liked,
        likes: done.likes,
    }))
}

/// A follow made (`true`) or taken back, paced per user.
async fn follow_answer(
    state: &AppState,
    request: &HttpRequest,
    caller: &Authenticated,
    path: &str,
    follow: bool,
) -> Result<HttpResponse, ApiError> {
    let creator = UserId::from_uuid(parse_id(path, "creator")?);
    paced(state, caller.user_id(), Pace::Follows).await?;
    let metadata = event_metadata(request, caller.actor());
    let done = if follow {
        state
            .gallery
            .follow(caller.user_id(), creator, &metadata)
            .await
    } else {
        state
            .gallery
            .unfollow(caller.user_id(), creator, &metadata)
            .await
    }
    .map_err(gallery_error)?;
    Ok(HttpResponse::Ok().json(FollowResponse {
        following: done.following,
        followers: done.followers,
    }))
}

/// A block made (`true`) or taken back, paced as follows are.
async fn block_answer(
    state: &AppState,
    request: &HttpRequest,
    caller: &Authenticated,
    path: &str,
    block: bool,
) -> Result<HttpResponse, ApiError> {
    let creator = UserId::from_uuid(parse_id(path, "creator")?);
    paced(state, caller.user_id(), Pace::Follows).await?;
    let metadata = event_metadata(request, caller.actor());
    if block {
        state
            .gallery
            .block(caller.user_id(), creator, &metadata)
            .await
    } else {
        state
            .gallery
            .unblock(caller.user_id(), creator, &metadata)
            .await
    }
    .map_err(gallery_error)?;
    Ok(HttpResponse::Ok().json(BlockResponse { blocked: block }))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportBody {
    /// What is wrong: `sexual`, `violent`, `illegal`, `infringement`, `spam` or `other`.
    pub reason: String,
    /// What the admins should know (one line, up to 200 characters); required with `other`.
    #[serde(default)]
    pub note: Option<String>,
}

/// Report a work to the admins (once per work: the same report again changes nothing).
#[utoipa::path(
    put, operation_id = "gallery_report", path = "/api/v1/gallery/works/{id}/report", tag = "gallery", security(("bearer" = [])),
    request_body = ReportBody,
    responses(
        (status = 204, description = "reported (or reported already in these words)"),
        (status = 404, description = "no such work, or not visible", body = crate::http::problem::Problem),
        (status = 409, description = "`already-reported`: the caller reported it before, otherwise", body = crate::http::problem::Problem),
        (status = 422, description = "a field's rule, or `reporting-own-work`", body = crate::http::problem::Problem),
        (status = 429, description = "`too-many-reports`", body = crate::http::problem::Problem)
    )
)]
pub async fn report(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
    body: crate::http::extract::Json<ReportBody>,
) -> Result<HttpResponse, ApiError> {
    let work_id = parse_id(&path, "work")?;
    paced(&state, caller.user_id(), Pace::Reports).await?;
    state
        .gallery
        .report(
            caller.user_id(),
            work_id,
            &body.reason,
            body.note.as_deref().unwrap_or_default(),
            &event_metadata(&request, caller.actor()),
        )
        .await
        .map_err(gallery_error)?;
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ReportedWorkResponse {
    pub work_id: Uuid,
    pub title: String,
    pub creator: Uuid,
    /// `published`, or `unpublished` when its creator took it down since.
    pub status: String,
    /// The first image as the public reads it (absent once its creator took the work down).
    pub cover: Option<String>,
    pub reports: u64,
    /// Each reason given, with how many gave it, the most given first.
    pub reasons: Vec<ReasonCount>,
    /// The reporters' notes, the earliest first.
    pub notes: Vec<String>,
    pub first_reported_at: DateTime<Utc>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ReasonCount {
    pub reason: String,
    pub reports: u64,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ReportedWorksResponse {
    /// The works with reports no admin has looked at (at most 100), the most reported first.
    pub works: Vec<ReportedWorkResponse>,
}

/// The works with open reports.
#[utoipa::path(
    get, operation_id = "gallery_reports", path = "/api/v1/admin/gallery/reports", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = ReportedWorksResponse), (status = 403, body = crate::http::problem::Problem))
)]
pub async fn reports(state: web::Data<AppState>, _admin: Admin) -> Result<HttpResponse, ApiError> {
    let works = state
        .gallery
        .reported_works()
        .await?
        .into_iter()
        .map(|work| ReportedWorkResponse {
            cover: work
                .cover
                .map(|image| public_image_path(work.work_id, &image)),
            work_id: work.work_id,
            title: work.title,
            creator: work.creator,
            status: work.status,
            reports: work.reports,
            reasons: work
                .reasons
                .into_iter()
                .map(|(reason, reports)| ReasonCount {
                    reason: reason.as_str().to_owned(),
                    reports,
                })
                .collect(),
            notes: work.notes,
            first_reported_at: work.first_reported_at,
        })
        .collect();
    Ok(HttpResponse::Ok().json(ReportedWorksResponse { works }))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DismissedResponse {
    /// How many open reports were dismissed.
    pub dismissed: u64,
}

/// Nothing wrong found: dismiss a work's open reports (to hide the work instead, hide it: that
/// upholds them).
#[utoipa::path(
    post, operation_id = "gallery_dismiss_reports", path = "/api/v1/admin/gallery/works/{id}/reports/dismiss", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = DismissedResponse), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn dismiss_reports(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let work_id = parse_id(&path, "work")?;
    let dismissed = state
        .gallery
        .dismiss_reports(
            admin.0.user_id,
            work_id,
            &event_metadata(&request, admin.actor()),
        )
        .await
        .map_err(gallery_error)?;
    Ok(HttpResponse::Ok().json(DismissedResponse { dismissed }))
}
