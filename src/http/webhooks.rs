//! `/api/v1/me/webhooks*`: a user's webhook endpoints (a session, or an API key with the
//! `webhooks` scope): register (the secret is in that answer only), list, rotate the secret,
//! enable, disable, remove, the delivery log, and redelivery of one message or a time range.

use crate::webhooks::safety::UnsafeUrl;
use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::webhook::{self, EndpointError};
use zhihui_domain::webhook::{EndpointCommand, WebhookEventType};

use crate::http::extract::Authenticated;
use crate::http::{ApiError, event_metadata};
use crate::state::AppState;
use crate::webhooks::{DeliveryView, EndpointView, EndpointWithSecret, WebhookError};

/// Messages one page of the delivery log shows, at most.
const DELIVERIES_PAGE_MAX: i64 = 100;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterEndpointRequest {
    /// An http(s) URL on a public address (an operator may allow networks).
    pub url: String,
    /// Any of `task.succeeded`, `task.failed`, `task.cancelled`, `points.credited`.
    pub event_types: Vec<String>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedeliverRequest {
    /// One message (its `webhook-id`)...
    pub message_id: Option<Uuid>,
    /// ...or every message that happened in `[since, until)`.
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Redelivered {
    /// Messages queued to be sent again.
    pub queued: u64,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct DeliveriesQuery {
    /// 1 to 100, default 20.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
}

fn webhook_error(error: WebhookError) -> ApiError {
    match error {
        WebhookError::Unsafe(unsafe_url) => ApiError::invalid(
            "url",
            match unsafe_url {
                UnsafeUrl::Malformed(detail) => {
                    Broken::new(Rule::UrlMalformed).with("detail", detail)
                }
                UnsafeUrl::Credentials => Broken::new(Rule::UrlCredentials),
                UnsafeUrl::Forbidden {
                    host,
                    address,
                    reason,
                } => Broken::new(Rule::UrlForbidden)
                    .with("host", host)
                    .with("address", address)
                    .with("reason", reason),
                UnsafeUrl::Unresolved(host) => Broken::new(Rule::UrlUnresolved).with("host", host),
            },
        ),
        WebhookError::Rejected(EndpointError::InvalidUrl) => ApiError::invalid(
            "url",
            Broken::new(Rule::HttpUrl).with("max", webhook::URL_LENGTH_MAX),
        ),
        WebhookError::Rejected(EndpointError::NoEventTypes) => ApiError::invalid(
            "event_types",
            Broken::new(Rule::AtLeastOneEventType).with("allowed", event_type_names()),
        ),
        WebhookError::Rejected(EndpointError::OverlapInPast) => {
            ApiError::invalid_by("previous_until", Rule::InFuture)
        }
        WebhookError::Rejected(error @ EndpointError::IdTaken(_)) => ApiError::Conflict {
            rule: "idempotency-key-reused",
            detail: error.to_string(),
        },
        WebhookError::Rejected(EndpointError::NotFound) | WebhookError::NotFound => {
            ApiError::NotFound("no such webhook endpoint".into())
        }
        error @ WebhookError::TooMany { .. } => ApiError::Conflict {
            rule: "too-many-webhooks",
            detail: error.to_string(),
        },
        WebhookError::Unexpected(error) => error.into(),
    }
}

fn event_type_names() -> String {
    WebhookEventType::ALL
        .map(WebhookEventType::as_str)
        .join(", ")
}

fn parse_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("no such webhook endpoint".into()))
}

/// Register an endpoint: called back on the event types it names. The answer carries its secret
/// (`whsec_...`), this once.
#[utoipa::path(
    post, operation_id = "register_webhook", path = "/api/v1/me/webhooks", tag = "webhooks", security(("bearer" = [])),
    request_body = RegisterEndpointRequest,
    responses(
        (status = 201, body = EndpointWithSecret),
        (status = 409, description = "`too-many-webhooks`", body = crate::http::problem::Problem),
        (status = 422, description = "`url` (not http(s), or an address webhooks never go to: loopback, private, link-local, metadata) or `event_types`", body = crate::http::problem::Problem),
    )
)]
pub async fn register(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<RegisterEndpointRequest>,
) -> Result<HttpResponse, ApiError> {
    let mut event_types = Vec::new();
    for text in &body.event_types {
        event_types.push(WebhookEventType::parse(text).ok_or_else(|| {
            ApiError::invalid(
                "event_types",
                Broken::new(Rule::NotEventType)
                    .with("value", format!("{text:?}"))
                    .with("allowed", event_type_names()),
            )
        })?);
    }
    let registered = state
        .webhooks
        .register(
            caller.user_id(),
            &body.url,
            event_types,
            &event_metadata(&request, caller.actor()),
        )
        .await
        .map_err(webhook_error)?;
    Ok(HttpResponse::Created().json(registered))
}

/// Your endpoints (never their secrets).
#[utoipa::path(
    get, operation_id = "list_webhooks", path = "/api/v1/me/webhooks", tag = "webhooks", security(("bearer" = [])),
    responses((status = 200, body = [EndpointView]))
)]
pub async fn list(
    state: web::Data<AppState>,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(state.webhooks.list(caller.user_id()).await?))
}

/// A new secret for an endpoint (in this answer only); the previous one keeps signing beside it
/// for `webhooks.rotation_overlap_ms`, so receivers can move over without missing a message.
#[utoipa::path(
    post, operation_id = "rotate_webhook_secret", path = "/api/v1/me/webhooks/{id}/rotate", tag = "webhooks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "endpoint id")),
    responses((status = 200, body = EndpointWithSecret), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn rotate(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let endpoint_id = parse_id(&path)?;
    let rotated = state
        .webhooks
        .rotate(
            caller.user_id(),
            endpoint_id,
            &event_metadata(&request, caller.actor()),
        )
        .await
        .map_err(webhook_error)?;
    Ok(HttpResponse::Ok().json(rotated))
}

async fn change(
    state: &AppState,
    request: &HttpRequest,
    caller: &Authenticated,
    raw_id: &str,
    command: EndpointCommand,
) -> Result<EndpointView, ApiError> {
    let endpoint_id = parse_id(raw_id)?;
    state
        .webhooks
        .change(
            Some(caller.user_id()),
            endpoint_id,
            command,
            &event_metadata(request, caller.actor()),
        )
        .await
        .map_err(webhook_error)
}

/// Stop sending to an endpoint (its messages are kept, skipped: a redelivery sends them).
#[utoipa::path(
    post, operation_id = "disable_webhook", path = "/api/v1/me/webhooks/{id}/disable", tag = "webhooks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "endpoint id")),
    responses((status = 200, body = EndpointView), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn disable(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let at = state.clock.now();
    let view = change(
        &state,
        &request,
        &caller,
        &path,
        EndpointCommand::Disable {
            reason: "disabled by its owner".into(),
            at,
        },
    )
    .await?;
    Ok(HttpResponse::Ok().json(view))
}

/// Send to an endpoint again (after its owner fixed it, or after it was disabled for failing).
#[utoipa::path(
    post, operation_id = "enable_webhook", path = "/api/v1/me/webhooks/{id}/enable", tag = "webhooks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "endpoint id")),
    responses((status = 200, body = EndpointView), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn enable(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let at = state.clock.now();
    let view = change(
        &state,
        &request,
        &caller,
        &path,
        EndpointCommand::Enable { at },
    )
    .await?;
    Ok(HttpResponse::Ok().json(view))
}

/// Remove an endpoint: nothing more is sent to it.
#[utoipa::path(
    delete, operation_id = "remove_webhook", path = "/api/v1/me/webhooks/{id}", tag = "webhooks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "endpoint id")),
    responses((status = 204, description = "removed"), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn remove(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let at = state.clock.now();
    change(
        &state,
        &request,
        &caller,
        &path,
        EndpointCommand::Remove { at },
    )
    .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// An endpoint's delivery log: its messages, newest first, each with every attempt (status,
/// latency, the answer's first bytes).
#[utoipa::path(
    get, operation_id = "webhook_deliveries", path = "/api/v1/me/webhooks/{id}/deliveries", tag = "webhooks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "endpoint id"), DeliveriesQuery),
    responses((status = 200, body = [DeliveryView]), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn deliveries(
    state: web::Data<AppState>,
    caller: Authenticated,
    path: web::Path<String>,
    query: crate::http::extract::Query<DeliveriesQuery>,
) -> Result<HttpResponse, ApiError> {
    let endpoint_id = parse_id(&path)?;
    let limit = query.limit.unwrap_or(20);
    if !(1..=DELIVERIES_PAGE_MAX).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            Broken::new(Rule::Between)
                .with("min", 1)
                .with("max", DELIVERIES_PAGE_MAX),
        ));
    }
    let log = state
        .webhooks
        .deliveries(caller.user_id(), endpoint_id, limit)
        .await
        .map_err(webhook_error)?;
    Ok(HttpResponse::Ok().json(log))
}

/// Send again one message (`message_id`), or every message of a time range (`since`, `until`).
#[utoipa::path(
    post, operation_id = "redeliver_webhook_messages", path = "/api/v1/me/webhooks/{id}/redeliver", tag = "webhooks", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "endpoint id")),
    request_body = RedeliverRequest,
    responses((status = 202, body = Redelivered), (status = 404, body = crate::http::problem::Problem), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn redeliver(
    state: web::Data<AppState>,
    caller: Authenticated,
    path: web::Path<String>,
    body: crate::http::extract::Json<RedeliverRequest>,
) -> Result<HttpResponse, ApiError> {
    let endpoint_id = parse_id(&path)?;
    let range = match (body.message_id, body.since, body.until) {
        (Some(_), None, None) => None,
        (None, Some(since), Some(until)) if since < until => Some((since, until)),
        (None, Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "until",
                Broken::new(Rule::After).with("other", "since"),
            ));
        }
        _ => {
            return Err(ApiError::invalid_by("message_id", Rule::MessageOrWindow));
        }
    };
    let queued = state
        .webhooks
        .redeliver(caller.user_id(), endpoint_id, body.message_id, range)
        .await
        .map_err(webhook_error)?;
    Ok(HttpResponse::Accepted().json(Redelivered { queued }))
}
