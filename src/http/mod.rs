//! The HTTP edge: routes, JSON DTOs and the mapping of errors to problem+json. Only this module
//! knows JSON shapes; the domain and the stores never see an HTTP type.

pub mod accounts;
pub(crate) mod auth;
pub(crate) mod backends;
pub(crate) mod checkins;
pub(crate) mod codes;
pub mod cookie;
pub mod deadline;
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

/// An API route to `handler`, answered 503 `request-overdue` past its deadline.
fn api<F, Args>(route: actix_web::Route, handler: F) -> actix_web::Route
where
    F: actix_web::Handler<Args>,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    deadline::within_deadline(route, handler, actix_web::HttpResponse::from_error)
}

/// Mount every route.
pub fn routes(config: &mut web::ServiceConfig) {
    config
        .app_data(json_config())
        .app_data(path_config())
        .app_data(query_config())
        .route("/health", api(web::get(), health::health))
        .route("/ready", api(web::get(), health::ready))
        .route("/api/openapi.json", api(web::get(), openapi::document))
        .service(
            web::scope("/api/v1")
                .route("/auth/register", api(web::post(), auth::register))
                .route("/auth/login", api(web::post(), auth::login))
                .route("/auth/code", api(web::post(), auth::send_code))
                .route("/auth/logout", api(web::post(), auth::logout))
                .route(
                    "/auth/password-reset",
                    api(web::post(), auth::reset_password),
                )
                .route("/me", api(web::get(), users::me))
                .route("/me/password", api(web::put(), users::change_password))
                .route("/me/phone", api(web::post(), users::bind_phone))
                .route("/me/display-name", api(web::put(), users::set_display_name))
                .route("/me/username", api(web::put(), users::set_username))
                .route("/me/keys", api(web::post(), keys::create))
                .route("/me/keys", api(web::get(), keys::list))
                .route("/me/keys/{key_id}", api(web::delete(), keys::revoke))
                .route(
                    "/admin/users/{id}/keys",
                    api(web::post(), keys::admin_create),
                )
                .route("/admin/users/{id}/keys", api(web::get(), keys::admin_list))
                .route(
                    "/admin/users/{id}/keys/{key_id}",
                    api(web::delete(), keys::admin_revoke),
                )
                .route("/me/webhooks", api(web::post(), webhooks::register))
                .route("/me/webhooks", api(web::get(), webhooks::list))
                .route("/me/webhooks/{id}", api(web::delete(), webhooks::remove))
                .route(
                    "/me/webhooks/{id}/rotate",
                    api(web::post(), webhooks::rotate),
                )
                .route(
                    "/me/webhooks/{id}/enable",
                    api(web::post(), webhooks::enable),
                )
                .route(
                    "/me/webhooks/{id}/disable",
                    api(web::post(), webhooks::disable),
                )
                .route(
                    "/me/webhooks/{id}/deliveries",
                    api(web::get(), webhooks::deliveries),
                )
                .route(
                    "/me/webhooks/{id}/redeliver",
                    api(web::post(), webhooks::redeliver),
                )
                .route("/users/{id}", api(web::get(), users::user))
                .route("/admin/users/{id}", api(web::get(), users::admin_user))
                .route(
                    "/admin/users/{id}/role",
                    api(web::put(), users::change_role),
                )
                .route("/account", api(web::get(), accounts::balance))
                .route("/account/ledger", api(web::get(), accounts::ledger))
                .route(
                    "/admin/accounts/{user}/grants",
                    api(web::post(), accounts::grant),
                )
                .route("/admin/projections", api(web::get(), accounts::projections))
                .route("/tasks", api(web::post(), tasks::submit))
                .route("/tasks", api(web::get(), tasks::tasks))
                .route("/tasks/{id}", api(web::get(), tasks::task))
                .route(
                    "/tasks/{id}/prioritise",
                    api(web::post(), tasks::prioritise),
                )
                .route("/tasks/{id}/cancel", api(web::post(), tasks::cancel))
                .route("/ws", api(web::get(), live::socket))
                .route("/ws/ticket", api(web::post(), live::ticket))
                .route("/images/{id}", api(web::get(), live::image))
                .route(
                    "/admin/images/{id}/original",
                    api(web::get(), live::original_image),
                )
                .route("/codes/redeem", api(web::post(), codes::redeem))
                .route("/admin/code-batches", api(web::post(), codes::create_batch))
                .route("/admin/code-batches/{id}", api(web::get(), codes::batch))
                .route(
                    "/admin/code-batches/{id}/revoke",
                    api(web::post(), codes::revoke),
                )
                .route(
                    "/admin/code-batches/{id}/codes.csv",
                    api(web::get(), codes::export),
                )
                .route("/gallery/hot", api(web::get(), gallery::hot))
                .route("/gallery/new", api(web::get(), gallery::newest))
                .route("/gallery/feed", api(web::get(), gallery::feed))
                .route("/gallery/likes", api(web::get(), gallery::my_likes))
                .route("/gallery/works", api(web::post(), gallery::publish))
                .route("/gallery/works/{id}", api(web::get(), gallery::work))
                .route(
                    "/gallery/works/{id}/unpublish",
                    api(web::post(), gallery::unpublish),
                )
                .route("/gallery/works/{id}/like", api(web::put(), gallery::like))
                .route(
                    "/gallery/works/{id}/like",
                    api(web::delete(), gallery::unlike),
                )
                .route(
                    "/gallery/works/{id}/images/{image}",
                    api(web::get(), gallery::image),
                )
                .route("/gallery/creators/{id}", api(web::get(), gallery::creator))
                .route(
                    "/gallery/creators/{id}/works",
                    api(web::get(), gallery::creator_works),
                )
                .route(
                    "/gallery/creators/{id}/follow",
                    api(web::put(), gallery::follow),
                )
                .route(
                    "/gallery/creators/{id}/follow",
                    api(web::delete(), gallery::unfollow),
                )
                .route(
                    "/gallery/creators/{id}/block",
                    api(web::put(), gallery::block),
                )
                .route(
                    "/gallery/creators/{id}/block",
                    api(web::delete(), gallery::unblock),
                )
                .route("/me/works", api(web::get(), gallery::my_works))
                .route(
                    "/admin/gallery/works/{id}/hide",
                    api(web::post(), gallery::hide),
                )
                .route(
                    "/admin/gallery/works/{id}/reports/dismiss",
                    api(web::post(), gallery::dismiss_reports),
                )
                .route("/admin/gallery/reports", api(web::get(), gallery::reports))
                .route(
                    "/gallery/works/{id}/report",
                    api(web::put(), gallery::report),
                )
                .route("/checkins", api(web::post(), checkins::check_in))
                .route("/checkins", api(web::get(), checkins::month))
                .route(
                    "/admin/stats/active-users",
                    api(web::get(), checkins::active_users),
                )
                .route("/promotions", api(web::get(), promotions::open))
                .route(
                    "/promotions/{id}/claims",
                    api(web::post(), promotions::claim),
                )
                .route(
                    "/promotions/{id}/claims/me",
                    api(web::get(), promotions::my_claim),
                )
                .route("/admin/promotions", api(web::post(), promotions::create))
                .route("/admin/promotions/{id}", api(web::get(), promotions::show))
                .route(
                    "/admin/promotions/{id}/end",
                    api(web::post(), promotions::end),
                )
                .route(
                    "/admin/promotions/{id}/stock",
                    api(web::post(), promotions::raise),
                )
                .route("/admin/backends", api(web::get(), backends::list))
                .route("/admin/backends", api(web::post(), backends::add))
                .route(
                    "/admin/backends/{name}",
                    api(web::delete(), backends::remove),
                )
                .route(
                    "/admin/backends/{name}/drain",
                    api(web::post(), backends::drain),
                )
                .route(
                    "/admin/backends/{name}/resume",
                    api(web::post(), backends::resume),
                )
                .route("/admin/queue", api(web::get(), tasks::queue))
                .route(
                    "/admin/queue/rebuild",
                    api(web::post(), tasks::rebuild_queue),
                ),
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
