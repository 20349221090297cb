//! The web app for users and admins: pages rendered on the server with minijinja, htmx for
//! partial updates, one small ES module (`assets/app.js`) for the live socket, all compiled into
//! the binary (no toolchain beyond cargo). A room of its own: routes (here), the session cookie
//! and CSRF (`session.rs`), templates (`templates/`, `render.rs`), assets (`assets/`,
//! `assets.rs`), translations (`i18n/`, `i18n.rs`), and the pages (`pages_auth.rs`,
//! `pages_user.rs`, `pages_admin.rs`).
//!
//! The pages call the same services and the same operations as the API (`crate::http`'s
//! `*_and_tell`, `task_view`, `ledger_page`, `grant_points`, ...): there is no second path around
//! a rule or a limit. Only the presentation differs: HTML, and refusals in the reader's words.
//!
//! Security: the session is an HttpOnly, SameSite=Strict cookie (Secure over HTTPS) holding the
//! same opaque token the API issues; page scripts cannot read it. Every state-changing request
//! carries a CSRF token (a digest keyed by the session token, `session::csrf_token`) in the
//! `X-CSRF-Token` header, which htmx sends from `hx-headers` on the body; a POST whose `Origin`
//! is another site is refused before anything else. Every page is served with a strict
//! Content-Security-Policy (no inline script or style), `frame-ancestors 'none'`, `nosniff` and
//! no referrer ([`security_headers`]). Everything a user typed reaches a page through
//! auto-escaped templates or `textContent`, never as markup.

mod assets;
pub mod i18n;
mod pages_admin;
mod pages_auth;
mod pages_gallery;
mod pages_settings;
mod pages_user;
mod render;
mod session;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderValue};
use actix_web::middleware::Next;
use actix_web::web;

pub use render::{Web, translate_failures};
pub use session::{CSRF_HEADER, SESSION_COOKIE, csrf_matches, csrf_token};

/// The Content-Security-Policy of every page: scripts, styles, images and sockets from this
/// origin only; no inline script or style, no plugins, no framing, forms post here only.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; font-src 'self'; \
     form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// Bytes a page's form may carry besides its prompts (title, choices, keys, the CSRF token).
pub const FORM_FIELDS_BYTES_MAX: usize = 8 * 1024;
/// URL-encoded bytes one character of a prompt may take at most: 4 UTF-8 bytes, each written
/// as `%XX`. A Chinese character takes 9.
pub const FORM_BYTES_PER_CHARACTER_MAX: usize = 12;

/// The body limit of the pages' forms, from the longest prompt and negative prompt the catalog
/// allows in their worst encoding: the largest form a person can type is never refused for its
/// size (a default 16 KB limit refused 1,000 Chinese characters in each field).
pub fn form_body_bytes_max(tasks: &crate::platform::configuration::TaskSettings) -> usize {
    (tasks.prompt_length_max + tasks.negative_prompt_length_max) * FORM_BYTES_PER_CHARACTER_MAX
        + FORM_FIELDS_BYTES_MAX
}

/// A page's route to `handler`: past its deadline, the failure page in the reader's language
/// (503, `Retry-After`).
fn page<F, Args>(route: actix_web::Route, handler: F) -> actix_web::Route
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    crate::http::deadline::within_deadline(route, handler, |overdue| {
        actix_web::HttpResponse::from_error(render::WebError::from(overdue))
    })
}

/// Mount the pages (after the API's routes).
pub fn routes(config: &mut web::ServiceConfig) {
    config
        .route("/", page(web::get(), pages_user::home))
        .route("/assets/{name}", page(web::get(), assets::serve))
        .route(
            "/lang/{lang}",
            page(web::post(), pages_auth::choose_language),
        )
        .route("/login", page(web::get(), pages_auth::login_page))
        .route("/login", page(web::post(), pages_auth::login))
        .route("/login/code", page(web::post(), pages_auth::send_code))
        .route("/password-reset", page(web::get(), pages_auth::reset_page))
        .route(
            "/password-reset",
            page(web::post(), pages_auth::reset_password),
        )
        .route(
            "/password-reset/code",
            page(web::post(), pages_auth::send_reset_code),
        )
        .route("/register", page(web::get(), pages_auth::register_page))
        .route("/register", page(web::post(), pages_auth::register))
        .route("/logout", page(web::post(), pages_auth::logout))
        .route(
            "/logout/password-reset",
            page(web::post(), pages_auth::logout_to_reset),
        )
        .route("/generate", page(web::get(), pages_user::generate_page))
        .route("/generate", page(web::post(), pages_user::generate))
        .route("/tasks/{id}", page(web::get(), pages_user::task_page))
        .route("/tasks/{id}/card", page(web::get(), pages_user::task_card))
        .route("/tasks/{id}/cancel", page(web::post(), pages_user::cancel))
        .route(
            "/tasks/{id}/prioritise",
            page(web::post(), pages_user::prioritise),
        )
        .route("/gallery", page(web::get(), pages_gallery::gallery))
        .route("/gallery/feed", page(web::get(), pages_gallery::feed))
        .route("/gallery/likes", page(web::get(), pages_gallery::likes))
        .route("/gallery/mine", page(web::get(), pages_gallery::mine))
        .route(
            "/gallery/publish",
            page(web::get(), pages_gallery::publish_page),
        )
        .route(
            "/gallery/publish",
            page(web::post(), pages_gallery::publish),
        )
        .route("/gallery/works/{id}", page(web::get(), pages_gallery::work))
        .route(
            "/gallery/works/{id}/like",
            page(web::post(), pages_gallery::like),
        )
        .route(
            "/gallery/works/{id}/unpublish",
            page(web::post(), pages_gallery::unpublish),
        )
        .route(
            "/gallery/works/{id}/hide",
            page(web::post(), pages_gallery::hide),
        )
        .route(
            "/gallery/works/{id}/report",
            page(web::post(), pages_gallery::report),
        )
        .route(
            "/gallery/creators/{id}",
            page(web::get(), pages_gallery::creator),
        )
        .route(
            "/gallery/creators/{id}/follow",
            page(web::post(), pages_gallery::follow),
        )
        .route(
            "/gallery/creators/{id}/block",
            page(web::post(), pages_gallery::block),
        )
        .route("/history", page(web::get(), pages_user::history))
        .route("/points", page(web::get(), pages_user::points))
        .route("/balance", page(web::get(), pages_user::balance))
        .route("/checkin", page(web::get(), pages_user::checkin_page))
        .route("/checkin", page(web::post(), pages_user::check_in))
        .route("/redeem", page(web::get(), pages_user::redeem_page))
        .route("/redeem", page(web::post(), pages_user::redeem))
        .route("/settings", page(web::get(), pages_settings::settings_page))
        .route(
            "/settings/keys",
            page(web::post(), pages_settings::create_key),
        )
        .route(
            "/settings/keys/{id}/revoke",
            page(web::post(), pages_settings::revoke_key),
        )
        .route(
            "/settings/password",
            page(web::post(), pages_settings::change_password),
        )
        .route(
            "/settings/phone/code",
            page(web::post(), pages_settings::send_phone_code),
        )
        .route(
            "/settings/phone",
            page(web::post(), pages_settings::bind_phone),
        )
        .route(
            "/settings/username",
            page(web::post(), pages_settings::set_username),
        )
        .route(
            "/settings/display-name",
            page(web::post(), pages_settings::set_display_name),
        )
        .route("/sales", page(web::get(), pages_user::sales))
        .route("/sales/{id}/claim", page(web::post(), pages_user::claim))
        .route(
            "/sales/{id}/claim",
            page(web::get(), pages_user::claim_state),
        )
        .route("/admin", page(web::get(), pages_admin::overview))
        .route("/admin/servers", page(web::get(), pages_admin::servers))
        .route("/admin/servers", page(web::post(), pages_admin::add_server))
        .route(
            "/admin/servers/{name}/{action}",
            page(web::post(), pages_admin::server_action),
        )
        .route("/admin/users", page(web::get(), pages_admin::users))
        .route("/admin/users/{id}", page(web::get(), pages_admin::user))
        .route(
            "/admin/users/{id}/grant",
            page(web::post(), pages_admin::grant),
        )
        .route(
            "/admin/users/{id}/role",
            page(web::post(), pages_admin::change_role),
        )
        .route("/admin/codes", page(web::get(), pages_admin::codes))
        .route("/admin/codes", page(web::post(), pages_admin::create_codes))
        .route(
            "/admin/codes/{id}",
            page(web::get(), pages_admin::code_batch),
        )
        .route(
            "/admin/codes/{id}/revoke",
            page(web::post(), pages_admin::revoke_codes),
        )
        .route(
            "/admin/promotions",
            page(web::get(), pages_admin::promotions),
        )
        .route(
            "/admin/promotions",
            page(web::post(), pages_admin::create_promotion),
        )
        .route(
            "/admin/promotions/{id}/stock",
            page(web::post(), pages_admin::raise_stock),
        )
        .route(
            "/admin/promotions/{id}/end",
            page(web::post(), pages_admin::end_promotion),
        )
        .route("/admin/reports", page(web::get(), pages_admin::reports))
        .route(
            "/admin/reports/{id}/dismiss",
            page(web::post(), pages_admin::dismiss_reports),
        )
        .route("/admin/audit", page(web::get(), pages_admin::audit));
}

/// What no route answers: a browser asking for a page gets the failure page in its language
/// with the site's navigation (404, or 405 for a path of ours under another method); programs
/// get the API's problem+json.
pub async fn fallback(request: actix_web::HttpRequest) -> actix_web::HttpResponse {
    let response = crate::http::fallback(request.clone()).await;
    if !render::wants_page(&request) {
        return response;
    }
    let status = response.status();
    let key = if status == actix_web::http::StatusCode::METHOD_NOT_ALLOWED {
        "error.method_not_allowed"
    } else {
        "error.not_found"
    };
    let Some(body) = render::failure_page(&request, status, key).await else {
        return response;
    };
    let mut page = actix_web::HttpResponse::build(status);
    page.content_type("text/html; charset=utf-8");
    if let Some(allow) = response.headers().get(header::ALLOW) {
        page.insert_header((header::ALLOW, allow.clone()));
    }
    page.body(body)
}

/// Security headers on every answer: pages get the strict CSP; every answer gets `nosniff`, is
/// never framed, and is `no-store` unless it set its own cache rule.
pub async fn security_headers(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let mut response = next.call(request).await?;
    let is_page = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/html"));
    let headers = response.headers_mut();
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if is_page {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        );
        headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
        headers.insert(
            header::REFERRER_POLICY,
            HeaderValue::from_static("same-origin"),
        );
        headers.insert(
            header::HeaderName::from_static("cross-origin-opener-policy"),
            HeaderValue::from_static("same-origin"),
        );
        headers.insert(
            header::HeaderName::from_static("permissions-policy"),
            HeaderValue::from_static("camera=(), microphone=(), geolocation=(), payment=()"),
        );
    } else if !headers.contains_key(header::HeaderName::from_static("content-security-policy")) {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        );
    }
    // A page or an API answer holds a person's data (a balance, a ledger, a task): never kept
    // by a cache unless it says otherwise itself (assets, images and public answers set their
    // own rule).
    if !headers.contains_key(header::CACHE_CONTROL) {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    Ok(response)
}
