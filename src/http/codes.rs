//! Redeem codes: `/api/v1/codes/redeem` (users) and `/api/v1/admin/code-batches*` (admins).

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::points::Amount;
use zhihui_domain::redeem::{Batch, BatchError, BatchSpec, SerialsError};
use zhihui_domain::rule::{Broken, Rule};

use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::points::codes::{BatchCommandError, RedeemError};
use crate::state::AppState;

/// Longest revocation reason.
pub const REVOKE_REASON_LENGTH_MAX: usize = 200;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RedeemRequest {
    /// The 10-character code; case, hyphens and spaces do not matter.
    pub code: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct RedeemResponse {
    /// False when the caller had already redeemed this code (nothing credited again).
    pub redeemed_now: bool,
    #[schema(value_type = String, example = "50.00")]
    pub points: Decimal,
    pub batch_id: Uuid,
    #[schema(value_type = String)]
    pub available: Decimal,
    #[schema(value_type = String)]
    pub frozen: Decimal,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// 1 to 1,000,000.
    #[serde(deserialize_with = "crate::http::extract::whole::u32")]
    pub count: u32,
    /// Points per code: positive, at most two decimals.
    #[schema(value_type = String, example = "50")]
    #[serde(deserialize_with = "crate::http::extract::decimal::plain_decimal")]
    pub points: Decimal,
    pub valid_from: DateTime<Utc>,
    /// After `valid_from`; a code redeems until just before it.
    pub valid_until: DateTime<Utc>,
    #[serde(default)]
    pub note: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BatchView {
    pub batch_id: Uuid,
    /// `issuing`, `issued` or `revoked`.
    pub status: &'static str,
    pub count: u32,
    /// Codes issued so far (they can be exported and redeemed).
    pub issued: u32,
    /// Codes redeemed (from the read model: may trail by moments).
    pub redeemed: i64,
    #[schema(value_type = String)]
    pub points: Decimal,
    pub valid_from: DateTime<Utc>,
    pub valid_until: DateTime<Utc>,
    pub note: String,
    pub first_serial: u32,
    pub key_slot: u8,
    pub created_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
}

impl BatchView {
    pub fn of(batch: &Batch, redeemed: i64) -> BatchView {
        BatchView {
            batch_id: batch.batch_id,
            status: if batch.revoked_at.is_some() {
                "revoked"
            } else if batch.is_complete() {
                "issued"
            } else {
                "issuing"
            },
            count: batch.spec.count,
            issued: batch.issued,
            redeemed,
            points: batch.spec.points.as_decimal(),
            valid_from: batch.spec.valid_from,
            valid_until: batch.spec.valid_until,
            note: batch.spec.note.clone(),
            first_serial: batch.first_serial,
            key_slot: batch.key_slot,
            created_at: batch.created_at,
            revoked_at: batch.revoked_at,
        }
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevokeRequest {
    pub reason: String,
}

/// Namespace of batch ids derived from `Idempotency-Key` headers.
const BATCH_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_6261_7463_6821);

pub fn redeem_error(error: RedeemError, state: &AppState) -> ApiError {
    match error {
        RedeemError::Invalid => ApiError::Refused {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            rule: "invalid-code",
            detail: "code: this is not a valid code".into(),
            window: None,
        },
        RedeemError::Limited { retry_at } => ApiError::TooManyRequests {
            rule: "too-many-failed-redemptions",
            detail: format!("too many failed redemptions; try again after {retry_at}"),
            retry_after_s: crate::http::retry_after(&state.clock, retry_at),
            retry_at,
        },
        RedeemError::Unknown => ApiError::NotFound("no such code".into()),
        error @ RedeemError::NotValidNow {
            valid_from,
            valid_until,
        } => ApiError::Refused {
            status: StatusCode::CONFLICT,
            rule: "code-not-valid-now",
            detail: error.to_string(),
            window: Some((valid_from, valid_until)),
        },
        RedeemError::Revoked => ApiError::Refused {
            status: StatusCode::CONFLICT,
            rule: "code-revoked",
            detail: "the code's batch was revoked".into(),
            window: None,
        },
        RedeemError::RedeemedByAnother => ApiError::Refused {
            status: StatusCode::CONFLICT,
            rule: "code-redeemed",
            detail: "the code was already redeemed".into(),
            window: None,
        },
        RedeemError::Contended => ApiError::Unavailable {
            dependencies: vec!["event-store".into()],
        },
        RedeemError::Store(error) => error.into(),
    }
}

fn batch_error(error: BatchCommandError) -> ApiError {
    match error {
        BatchCommandError::Batch(BatchError::Spec(spec)) => {
            ApiError::invalid(spec.field, spec.broken)
        }
        BatchCommandError::Batch(BatchError::NotFound) => {
            ApiError::NotFound("no such batch".into())
        }
        BatchCommandError::Batch(error @ BatchError::AlreadyExists(_)) => ApiError::Conflict {
            rule: "idempotency-key-reused",
            detail: format!("{error}: this Idempotency-Key was used for another batch"),
        },
        BatchCommandError::Batch(error) => ApiError::Conflict {
            rule: "batch-rule",
            detail: error.to_string(),
        },
        BatchCommandError::Serials(error @ SerialsError::Exhausted { .. }) => ApiError::Conflict {
            rule: "serials-exhausted",
            detail: error.to_string(),
        },
        BatchCommandError::Serials(error) => ApiError::Conflict {
            rule: "idempotency-key-reused",
            detail: error.to_string(),
        },
        BatchCommandError::Contended(_) => ApiError::Unavailable {
            dependencies: vec!["event-store".into()],
        },
        BatchCommandError::Store(error) => error.into(),
    }
}

/// Redeem a code: its points are credited to the caller.
#[utoipa::path(
    post, path = "/api/v1/codes/redeem", tag = "account", security(("bearer" = [])),
    request_body = RedeemRequest,
    responses(
        (status = 200, body = RedeemResponse),
        (status = 401, body = crate::http::problem::Problem),
        (status = 404, description = "no code has this serial", body = crate::http::problem::Problem),
        (status = 409, description = "`code-not-valid-now` (with `valid_from`, `valid_until`), `code-revoked`, `code-redeemed`", body = crate::http::problem::Problem),
        (status = 422, description = "`invalid-code`: malformed, mistyped or forged", body = crate::http::problem::Problem),
        (status = 429, description = "`too-many-failed-redemptions`, with `Retry-After`", body = crate::http::problem::Problem),
    )
)]
pub async fn redeem(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<RedeemRequest>,
) -> Result<HttpResponse, ApiError> {
    let redemption = state
        .codes
        .redeem(
            caller.user_id(),
            &body.code,
            &event_metadata(&request, caller.actor()),
        )
        .await
        .map_err(|error| redeem_error(error, &state))?;
    let balance = redemption.account.balance;
    Ok(HttpResponse::Ok().json(RedeemResponse {
        redeemed_now: redemption.redeemed_now,
        points: two_places(redemption.points.as_decimal()),
        batch_id: redemption.batch_id,
        available: two_places(balance.available.as_decimal()),
        frozen: two_places(balance.frozen.as_decimal()),
    }))
}

fn two_places(mut value: Decimal) -> Decimal {
    value.rescale(zhihui_domain::points::POINTS_SCALE);
    value
}

/// Issue a batch of codes: answered at once, the codes are generated in the background (follow
/// `GET /api/v1/admin/code-batches/{id}`). Send an `Idempotency-Key` to make retries safe.
#[utoipa::path(
    post, path = "/api/v1/admin/code-batches", tag = "admin", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "same key, same batch")),
    request_body = BatchRequest,
    responses(
        (status = 202, body = BatchView),
        (status = 403, body = crate::http::problem::Problem),
        (status = 409, description = "`serials-exhausted`, `idempotency-key-reused`", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule (named)", body = crate::http::problem::Problem),
    )
)]
pub async fn create_batch(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    body: crate::http::extract::Json<BatchRequest>,
) -> Result<HttpResponse, ApiError> {
    let batch_id = match crate::http::accounts::idempotency_key(&request)? {
        None => Uuid::now_v7(),
        Some(key) => Uuid::new_v5(&BATCH_NAMESPACE, key.as_bytes()),
    };
    let metadata = event_metadata(&request, admin.actor());
    let view = create_batch_of(&state, &admin, batch_id, &body, &metadata).await?;
    Ok(HttpResponse::Accepted()
        .insert_header((
            actix_web::http::header::LOCATION,
            format!("/api/v1/admin/code-batches/{batch_id}"),
        ))
        .json(view))
}

/// The batch id of an idempotency key (the admin pages use one per form).
pub(crate) fn batch_id_of_key(key: &str) -> Uuid {
    Uuid::new_v5(&BATCH_NAMESPACE, key.as_bytes())
}

/// Create a batch (the API and the admin pages): its codes are issued in the background.
pub(crate) async fn create_batch_of(
    state: &AppState,
    _admin: &Admin,
    batch_id: Uuid,
    body: &BatchRequest,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<BatchView, ApiError> {
    let points =
        Amount::parse(body.points).map_err(|error| ApiError::invalid("points", error.0))?;
    let spec = BatchSpec {
        count: body.count,
        points,
        valid_from: body.valid_from,
        valid_until: body.valid_until,
        note: body.note.trim().to_owned(),
    };
    let batch = state
        .codes
        .create_batch(batch_id, spec, metadata)
        .await
        .map_err(batch_error)?;
    Ok(BatchView::of(&batch, 0))
}

pub(crate) fn parse_batch_id(path: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(path).map_err(|_| ApiError::NotFound("no such batch".into()))
}

async fn load_batch(state: &AppState, batch_id: Uuid) -> Result<Batch, ApiError> {
    state
        .codes
        .batch(batch_id)
        .await?
        .map(|(batch, _)| batch)
        .ok_or_else(|| ApiError::NotFound("no such batch".into()))
}

/// A batch and its progress (from its stream: current to the last page).
#[utoipa::path(
    get, path = "/api/v1/admin/code-batches/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "batch id")),
    responses((status = 200, body = BatchView), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn batch(
    state: web::Data<AppState>,
    _admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(batch_view(&state, parse_batch_id(&path)?).await?))
}

/// A batch and its progress (the API and the admin pages).
pub(crate) async fn batch_view(state: &AppState, batch_id: Uuid) -> Result<BatchView, ApiError> {
    let batch = load_batch(state, batch_id).await?;
    let redeemed = state.codes.redeemed_count(batch.batch_id).await?;
    Ok(BatchView::of(&batch, redeemed))
}

/// Revoke a batch: its codes not redeemed yet stop working.
#[utoipa::path(
    post, path = "/api/v1/admin/code-batches/{id}/revoke", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "batch id")),
    request_body = RevokeRequest,
    responses((status = 200, body = BatchView), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn revoke(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
    body: crate::http::extract::Json<RevokeRequest>,
) -> Result<HttpResponse, ApiError> {
    let batch_id = parse_batch_id(&path)?;
    let metadata = event_metadata(&request, admin.actor());
    let view = revoke_batch(&state, &admin, batch_id, &body.reason, &metadata).await?;
    Ok(HttpResponse::Ok().json(view))
}

/// Revoke a batch (the API and the admin pages).
pub(crate) async fn revoke_batch(
    state: &AppState,
    _admin: &Admin,
    batch_id: Uuid,
    reason: &str,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<BatchView, ApiError> {
    let reason = reason.trim();
    if zhihui_domain::text::is_blank(reason) || reason.chars().count() > REVOKE_REASON_LENGTH_MAX {
        return Err(ApiError::invalid(
            "reason",
            Broken::new(Rule::LengthBetween)
                .with("min", 1)
                .with("max", REVOKE_REASON_LENGTH_MAX),
        ));
    }
    zhihui_domain::text::refuse_controls(reason, false)
        .map_err(|broken| ApiError::invalid("reason", broken))?;
    let batch = state
        .codes
        .revoke(batch_id, reason.to_owned(), metadata)
        .await
        .map_err(batch_error)?;
    let redeemed = state.codes.redeemed_count(batch_id).await?;
    Ok(BatchView::of(&batch, redeemed))
}

/// The issued codes of a batch as CSV (streamed): `serial,code,points,valid_from,valid_until,
/// redeemed_by,redeemed_at`.
#[utoipa::path(
    get, path = "/api/v1/admin/code-batches/{id}/codes.csv", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "batch id")),
    responses((status = 200, description = "text/csv", content_type = "text/csv", body = String), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn export(
    state: web::Data<AppState>,
    _admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let batch = load_batch(&state, parse_batch_id(&path)?).await?;
    let file_name = format!("codes-{}.csv", batch.batch_id);
    // The first chunk is read before the answer starts: a store away then is a 503 to retry,
    // not a 200 cut short. A failure later can only end the stream.
    let mut chunks = Box::pin(state.codes.export(batch));
    let first = futures::StreamExt::next(&mut chunks).await.transpose()?;
    let rest = futures::StreamExt::map(chunks, |chunk| {
        chunk.map_err(|error| {
            tracing::error!(error = %crate::platform::telemetry::error_chain(&error), "code export failed mid-stream");
            actix_web::error::ErrorInternalServerError("export failed")
        })
    });
    let body = futures::StreamExt::chain(futures::stream::iter(first.map(Ok)), rest);
    Ok(HttpResponse::Ok()
        .content_type("text/csv; charset=utf-8")
        .insert_header((
            actix_web::http::header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{file_name}\""),
        ))
        .streaming(body))
}
