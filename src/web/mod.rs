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

/// Mount the pages (after the API's routes).
pub fn routes(config: &mut web::ServiceConfig) {
    config
        .route("/", web::get().to(pages_user::home))
        .route("/assets/{name}", web::get().to(assets::serve))
        .route("/lang/{lang}", web::post().to(pages_auth::choose_language))
        .route("/login", web::get().to(pages_auth::login_page))
        .route("/login", web::post().to(pages_auth::login))
        .route("/login/code", web::post().to(pages_auth::send_code))
        .route("/register", web::get().to(pages_auth::register_page))
        .route("/register", web::post().to(pages_auth::register))
        .route("/logout", web::post().to(pages_auth::logout))
        .route("/generate", web::get().to(pages_user::generate_page))
        .route("/generate", web::post().to(pages_user::generate))
        .route("/tasks/{id}", web::get().to(pages_user::task_page))
        .route("/tasks/{id}/card", web::get().to(pages_user::task_card))
        .route("/tasks/{id}/cancel", web::post().to(pages_user::cancel))
        .route(
            "/tasks/{id}/prioritise",
            web::post().to(pages_user::prioritise),
        )
        .route("/gallery", web::get().to(pages_gallery::gallery))
        .route("/gallery/feed", web::get().to(pages_gallery::feed))
        .route("/gallery/likes", web::get().to(pages_gallery::likes))
        .route("/gallery/mine", web::get().to(pages_gallery::mine))
        .route(
            "/gallery/publish",
            web::get().to(pages_gallery::publish_page),
        )
        .route("/gallery/publish", web::post().to(pages_gallery::publish))
        .route("/gallery/works/{id}", web::get().to(pages_gallery::work))
        .route(
            "/gallery/works/{id}/like",
            web::post().to(pages_gallery::like),
        )
        .route(
            "/gallery/works/{id}/unpublish",
            web::post().to(pages_gallery::unpublish),
        )
        .route(
            "/gallery/works/{id}/hide",
            web::post().to(pages_gallery::hide),
        )
        .route(
            "/gallery/creators/{id}",
            web::get().to(pages_gallery::creator),
        )
        .route(
            "/gallery/creators/{id}/follow",
            web::post().to(pages_gallery::follow),
        )
        .route(
            "/gallery/creators/{id}/block",
            web::post().to(pages_gallery::block),
        )
        .route("/history", web::get().to(pages_user::history))
        .route("/points", web::get().to(pages_user::points))
        .route("/balance", web::get().to(pages_user::balance))
        .route("/checkin", web::get().to(pages_user::checkin_page))
        .route("/checkin", web::post().to(pages_user::check_in))
        .route("/redeem", web::get().to(pages_user::redeem_page))
        .route("/redeem", web::post().to(pages_user::redeem))
        .route("/settings", web::get().to(pages_settings::settings_page))
        .route("/settings/keys", web::post().to(pages_settings::create_key))
        .route(
            "/settings/keys/{id}/revoke",
            web::post().to(pages_settings::revoke_key),
        )
        .route(
            "/settings/password",
            web::post().to(pages_settings::change_password),
        )
        .route("/sales", web::get().to(pages_user::sales))
        .route("/sales/{id}/claim", web::post().to(pages_user::claim))
        .route("/sales/{id}/claim", web::get().to(pages_user::claim_state))
        .route("/admin", web::get().to(pages_admin::overview))
        .route("/admin/servers", web::get().to(pages_admin::servers))
        .route("/admin/servers", web::post().to(pages_admin::add_server))
        .route(
            "/admin/servers/{name}/{action}",
            web::post().to(pages_admin::server_action),
        )
        .route("/admin/users", web::get().to(pages_admin::users))
        .route("/admin/users/{id}", web::get().to(pages_admin::user))
        .route(
            "/admin/users/{id}/grant",
            web::post().to(pages_admin::grant),
        )
        .route(
            "/admin/users/{id}/role",
            web::post().to(pages_admin::change_role),
        )
        .route("/admin/codes", web::get().to(pages_admin::codes))
        .route("/admin/codes", web::post().to(pages_admin::create_codes))
        .route("/admin/codes/{id}", web::get().to(pages_admin::code_batch))
        .route(
            "/admin/codes/{id}/revoke",
            web::post().to(pages_admin::revoke_codes),
        )
        .route("/admin/promotions", web::get().to(pages_admin::promotions))
        .route(
            "/admin/promotions",
            web::post().to(pages_admin::create_promotion),
        )
        .route(
            "/admin/promotions/{id}/stock",
            web::post().to(pages_admin::raise_stock),
        )
        .route(
            "/admin/promotions/{id}/end",
            web::post().to(pages_admin::end_promotion),
        )
        .route("/admin/audit", web::get().to(pages_admin::audit));
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
