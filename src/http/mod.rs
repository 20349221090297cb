//! The HTTP edge: routes, JSON DTOs and the mapping of errors to problem+json. Only this module
//! knows JSON shapes; the domain and the stores never see an HTTP type.

pub mod accounts;
pub(crate) mod auth;
pub(crate) mod backends;
pub(crate) mod checkins;
pub(crate) mod codes;
pub mod cookie;
pub mod extract;
pub mod gallery;
mod health;
pub(crate) mod keys;
mod live;
pub mod metrics;
mod openapi;
pub mod problem;
pub(crate) mod promotions;
pub(crate) mod tasks;
pub(crate) mod users;
pub(crate) mod webhooks;

use actix_web::{HttpRequest, web};
use chrono::{DateTime, Utc};
use uuid::Uuid;
use zhihui_domain::rule::{Broken, Rule};

pub use openapi::ApiDoc;
pub use problem::ApiError;

use crate::platform::clock::Clock;
use crate::platform::event_store::EventMetadata;

/// Largest JSON body accepted. Requests here are small forms; a bigger body is a mistake or abuse.
pub const JSON_BODY_BYTES_MAX: usize = 64 * 1024;

/// Header a client may set to tie its request to events and logs (a UUID); one is made otherwise.
pub const CORRELATION_ID_HEADER: &str = "x-correlation-id";

/// Mount every route.
pub fn routes(config: &mut web::ServiceConfig) {
    config
        .app_data(json_config())
        .app_data(path_config())
        .app_data(query_config())
        .route("/health", web::get().to(health::health))
        .route("/ready", web::get().to(health::ready))
        .route("/api/openapi.json", web::get().to(openapi::document))
        .service(
            web::scope("/api/v1")
                .route("/auth/register", web::post().to(auth::register))
                .route("/auth/login", web::post().to(auth::login))
                .route("/auth/code", web::post().to(auth::send_code))
                .route("/auth/logout", web::post().to(auth::logout))
                .route("/me", web::get().to(users::me))
                .route("/me/password", web::put().to(users::change_password))
                .route("/me/phone", web::post().to(users::bind_phone))
                .route("/me/keys", web::post().to(keys::create))
                .route("/me/keys", web::get().to(keys::list))
                .route("/me/keys/{key_id}", web::delete().to(keys::revoke))
                .route("/admin/users/{id}/keys", web::post().to(keys::admin_create))
                .route("/admin/users/{id}/keys", web::get().to(keys::admin_list))
                .route(
                    "/admin/users/{id}/keys/{key_id}",
                    web::delete().to(keys::admin_revoke),
                )
                .route("/me/webhooks", web::post().to(webhooks::register))
                .route("/me/webhooks", web::get().to(webhooks::list))
                .route("/me/webhooks/{id}", web::delete().to(webhooks::remove))
                .route("/me/webhooks/{id}/rotate", web::post().to(webhooks::rotate))
                .route("/me/webhooks/{id}/enable", web::post().to(webhooks::enable))
                .route(
                    "/me/webhooks/{id}/disable",
                    web::post().to(webhooks::disable),
                )
                .route(
                    "/me/webhooks/{id}/deliveries",
                    web::get().to(webhooks::deliveries),
                )
                .route(
                    "/me/webhooks/{id}/redeliver",
                    web::post().to(webhooks::redeliver),
                )
                .route("/users/{id}", web::get().to(users::user))
                .route("/admin/users/{id}", web::get().to(users::admin_user))
                .route("/admin/users/{id}/role", web::put().to(users::change_role))
                .route("/account", web::get().to(accounts::balance))
                .route("/account/ledger", web::get().to(accounts::ledger))
                .route(
                    "/admin/accounts/{user}/grants",
                    web::post().to(accounts::grant),
                )
                .route("/admin/projections", web::get().to(accounts::projections))
                .route("/tasks", web::post().to(tasks::submit))
                .route("/tasks", web::get().to(tasks::tasks))
                .route("/tasks/{id}", web::get().to(tasks::task))
                .route("/tasks/{id}/prioritise", web::post().to(tasks::prioritise))
                .route("/tasks/{id}/cancel", web::post().to(tasks::cancel))
                .route("/ws", web::get().to(live::socket))
                .route("/ws/ticket", web::post().to(live::ticket))
                .route("/images/{id}", web::get().to(live::image))
                .route(
                    "/admin/images/{id}/original",
                    web::get().to(live::original_image),
                )
                .route("/codes/redeem", web::post().to(codes::redeem))
                .route("/admin/code-batches", web::post().to(codes::create_batch))
                .route("/admin/code-batches/{id}", web::get().to(codes::batch))
                .route(
                    "/admin/code-batches/{id}/revoke",
                    web::post().to(codes::revoke),
                )
                .route(
                    "/admin/code-batches/{id}/codes.csv",
                    web::get().to(codes::export),
                )
                .route("/gallery/hot", web::get().to(gallery::hot))
                .route("/gallery/new", web::get().to(gallery::newest))
                .route("/gallery/feed", web::get().to(gallery::feed))
                .route("/gallery/likes", web::get().to(gallery::my_likes))
                .route("/gallery/works", web::post().to(gallery::publish))
                .route("/gallery/works/{id}", web::get().to(gallery::work))
                .route(
                    "/gallery/works/{id}/unpublish",
                    web::post().to(gallery::unpublish),
                )
                .route("/gallery/works/{id}/like", web::put().to(gallery::like))
                .route(
                    "/gallery/works/{id}/like",
                    web::delete().to(gallery::unlike),
                )
                .route(
                    "/gallery/works/{id}/images/{image}",
                    web::get().to(gallery::image),
                )
                .route("/gallery/creators/{id}", web::get().to(gallery::creator))
                .route(
                    "/gallery/creators/{id}/works",
                    web::get().to(gallery::creator_works),
                )
                .route(
                    "/gallery/creators/{id}/follow",
                    web::put().to(gallery::follow),
                )
                .route(
                    "/gallery/creators/{id}/follow",
                    web::delete().to(gallery::unfollow),
                )
                .route(
                    "/gallery/creators/{id}/block",
                    web::put().to(gallery::block),
                )
                .route(
                    "/gallery/creators/{id}/block",
                    web::delete().to(gallery::unblock),
                )
                .route("/me/works", web::get().to(gallery::my_works))
                .route(
                    "/admin/gallery/works/{id}/hide",
                    web::post().to(gallery::hide),
                )
                .route("/checkins", web::post().to(checkins::check_in))
                .route("/checkins", web::get().to(checkins::month))
                .route(
                    "/admin/stats/active-users",
                    web::get().to(checkins::active_users),
                )
                .route("/promotions", web::get().to(promotions::open))
                .route("/promotions/{id}/claims", web::post().to(promotions::claim))
                .route(
                    "/promotions/{id}/claims/me",
                    web::get().to(promotions::my_claim),
                )
                .route("/admin/promotions", web::post().to(promotions::create))
                .route("/admin/promotions/{id}", web::get().to(promotions::show))
                .route(
                    "/admin/promotions/{id}/end",
                    web::post().to(promotions::end),
                )
                .route(
                    "/admin/promotions/{id}/stock",
                    web::post().to(promotions::raise),
                )
                .route("/admin/backends", web::get().to(backends::list))
                .route("/admin/backends", web::post().to(backends::add))
                .route("/admin/backends/{name}", web::delete().to(backends::remove))
                .route(
                    "/admin/backends/{name}/drain",
                    web::post().to(backends::drain),
                )
                .route(
                    "/admin/backends/{name}/resume",
                    web::post().to(backends::resume),
                )
                .route("/admin/queue", web::get().to(tasks::queue))
                .route("/admin/queue/rebuild", web::post().to(tasks::rebuild_queue)),
        );
}

/// What no route answers: 405 with `Allow` when the path is one of ours under another method
/// (the OpenAPI document's paths, `{param}` matching any one segment), else 404; both
/// problem+json.
pub async fn fallback(request: actix_web::HttpRequest) -> actix_web::HttpResponse {
    use actix_web::ResponseError;
    let allowed = allowed_methods(request.path());
    if allowed.is_empty() {
        return ApiError::NotFound(format!("no such route: {}", request.path())).error_response();
    }
    let mut response = ApiError::Refused {
        status: actix_web::http::StatusCode::METHOD_NOT_ALLOWED,
        rule: "method-not-allowed",
        detail: format!("{} takes {}", request.path(), allowed.join(", ")),
        window: None,
    }
    .error_response();
    if let Ok(value) = actix_web::http::header::HeaderValue::from_str(&allowed.join(", ")) {
        response
            .headers_mut()
            .insert(actix_web::http::header::ALLOW, value);
    }
    response
}

/// The methods the API document lists for a concrete path.
fn allowed_methods(path: &str) -> Vec<String> {
    static PATHS: std::sync::OnceLock<Vec<(Vec<String>, Vec<String>)>> = std::sync::OnceLock::new();
    let paths = PATHS.get_or_init(|| {
        let document = openapi::document_json();
        let mut paths = Vec::new();
        if let Some(items) = document.get("paths").and_then(serde_json::Value::as_object) {
            for (template, item) in items {
                let segments = template.split('/').map(str::to_owned).collect();
                let methods = item
                    .as_object()
                    .map(|item| item.keys().map(|method| method.to_uppercase()).collect())
                    .unwrap_or_default();
                paths.push((segments, methods));
            }
        }
        paths
    });
    let segments: Vec<&str> = path.split('/').collect();
    let mut allowed: Vec<String> = paths
        .iter()
        .filter(|(template, _)| {
            template.len() == segments.len()
                && template.iter().zip(&segments).all(|(expected, actual)| {
                    (expected.starts_with('{') && !actual.is_empty()) || expected == actual
                })
        })
        .flat_map(|(_, methods)| methods.iter().cloned())
        .collect();
    allowed.sort();
    allowed.dedup();
    allowed
}

/// Query parameters whose values never reach a log line: bearer tokens (a browser's WebSocket
/// sends its token as `?token=`), one-time codes, tickets, cursors, passwords.
const SECRET_QUERY_PARAMETERS: &[&str] = &["token", "code", "ticket", "cursor", "password"];

/// `METHOD /path?query HTTP/x` for the access log, each secret parameter's value replaced by
/// `REDACTED` (names compared case-insensitively, percent-encoded names decoded first).
pub fn redacted_request_line(
    method: &str,
    path: &str,
    query: &str,
    version: actix_web::http::Version,
) -> String {
    let query = query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decoded = percent_decoded_lowercase(name);
            if SECRET_QUERY_PARAMETERS.contains(&decoded.as_str()) && !value.is_empty() {
                format!("{name}=REDACTED")
            } else {
                pair.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("&");
    let separator = if query.is_empty() { "" } else { "?" };
    format!("{method} {path}{separator}{query} {version:?}")
}

fn percent_decoded_lowercase(name: &str) -> String {
    let bytes = name.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let hex = |byte: u8| char::from(byte).to_digit(16);
        match (bytes[index], bytes.get(index + 1), bytes.get(index + 2)) {
            (b'%', Some(high), Some(low)) if hex(*high).is_some() && hex(*low).is_some() => {
                let value = hex(*high).unwrap_or(0) * 16 + hex(*low).unwrap_or(0);
                decoded.push(u8::try_from(value).unwrap_or(b'?'));
                index += 3;
            }
            (b'+', _, _) => {
                decoded.push(b' ');
                index += 1;
            }
            (byte, _, _) => {
                decoded.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).to_lowercase()
}

/// Malformed JSON answers a problem+json naming what was wrong, not actix's plain-text 400.
fn json_config() -> web::JsonConfig {
    web::JsonConfig::default()
        .limit(JSON_BODY_BYTES_MAX)
        .error_handler(|error, _request| {
            if let actix_web::error::JsonPayloadError::Overflow { limit }
            | actix_web::error::JsonPayloadError::OverflowKnownLength { limit, .. } = &error
            {
                return ApiError::Refused {
                    status: actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
                    rule: "body-too-large",
                    detail: format!("the body must be at most {limit} bytes"),
                    window: None,
                }
                .into();
            }
            let unreadable = |detail: String| Broken::new(Rule::Unreadable).with("detail", detail);
            match &error {
                actix_web::error::JsonPayloadError::Deserialize(inner) => {
                    // serde names the missing or mistyped field in its message.
                    ApiError::invalid("body", unreadable(inner.to_string()))
                }
                actix_web::error::JsonPayloadError::ContentType => {
                    ApiError::invalid_by("content-type", Rule::JsonContentType)
                }
                other => ApiError::invalid("body", unreadable(other.to_string())),
            }
            .into()
        })
}

/// A page's form that cannot be read (too large, not a form, a field missing or garbled): a
/// problem naming it, which the pages write again in the reader's language, never actix's
/// plain-text 400.
pub fn form_config(limit: usize) -> web::FormConfig {
    web::FormConfig::default()
        .limit(limit)
        .error_handler(|error, _request| {
            match error {
                actix_web::error::UrlencodedError::Overflow { limit, .. } => ApiError::Refused {
                    status: actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
                    rule: "body-too-large",
                    detail: format!("the form must be at most {limit} bytes"),
                    window: None,
                },
                other => ApiError::invalid(
                    "form",
                    Broken::new(Rule::Unreadable).with("detail", other.to_string()),
                ),
            }
            .into()
        })
}

fn query_config() -> web::QueryConfig {
    web::QueryConfig::default().error_handler(|error, _request| {
        ApiError::invalid("query", Broken::new(Rule::Unreadable).with("detail", error)).into()
    })
}

fn path_config() -> web::PathConfig {
    web::PathConfig::default()
        .error_handler(|_error, _request| ApiError::NotFound("no such resource".into()).into())
}

/// Metadata for the events a request causes: its correlation id (from the header when it is a
/// UUID, else fresh) and who acted.
pub fn event_metadata(request: &HttpRequest, actor: String) -> EventMetadata {
    let correlation_id = request
        .headers()
        .get(CORRELATION_ID_HEADER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| Uuid::parse_str(value).ok())
        .unwrap_or_else(Uuid::now_v7);
    EventMetadata {
        correlation_id,
        causation_id: None,
        actor,
    }
}

/// Whole seconds until `at` by the application clock, at least 1 (for `Retry-After`).
pub fn retry_after(clock: &Clock, at: DateTime<Utc>) -> u64 {
    let millis = (at - clock.now()).num_milliseconds().max(0);
    u64::try_from(millis).unwrap_or(0).div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::redacted_request_line;
    use actix_web::http::Version;

    #[test]
    fn secret_query_values_never_reach_the_log_line() {
        assert_eq!(
            redacted_request_line("GET", "/api/v1/ws", "token=abc.def&x=1", Version::HTTP_11),
            "GET /api/v1/ws?token=REDACTED&x=1 HTTP/1.1"
        );
        assert_eq!(
            redacted_request_line(
                "GET",
                "/api/v1/tasks",
                "limit=5&CURSOR=1_2&%74oken=s3cret&code=123456&empty=",
                Version::HTTP_11
            ),
            "GET /api/v1/tasks?limit=5&CURSOR=REDACTED&%74oken=REDACTED&code=REDACTED&empty= HTTP/1.1"
        );
        assert_eq!(
            redacted_request_line("POST", "/api/v1/checkins", "", Version::HTTP_2),
            "POST /api/v1/checkins HTTP/2.0"
        );
    }
}
