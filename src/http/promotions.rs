//! Flash-sale promotions: `/api/v1/promotions*` (users) and `/api/v1/admin/promotions*` (admins).

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use anyhow::Context;
use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::points::Amount;
use zhihui_domain::promotion::{PromotionCommand, PromotionError, PromotionSpec, PromotionState};

use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::platform::command::CommandError;
use crate::points::promotions::ClaimError;
use crate::state::AppState;

const PROMOTION_NAMESPACE: Uuid = Uuid::from_u128(0x51a3_e7c2_08d4_4f61_a2b9_6e0d_13c5_78f4);

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PromotionRequest {
    /// 1 to 100 characters.
    pub title: String,
    /// Points credited per claim: positive, at most two decimals.
    #[schema(value_type = String, example = "100")]
    #[serde(deserialize_with = "crate::http::extract::decimal::plain_decimal")]
    pub points: Decimal,
    /// Points charged per claim: 0 (free) or positive, at most two decimals.
    #[schema(value_type = String, example = "0")]
    #[serde(deserialize_with = "crate::http::extract::decimal::plain_decimal")]
    pub price: Decimal,
    /// 1 to 1,000,000.
    #[serde(deserialize_with = "crate::http::extract::whole::u32")]
    pub stock: u32,
    pub starts_at: DateTime<Utc>,
    /// After `starts_at`; claims are accepted until just before it.
    pub ends_at: DateTime<Utc>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct PromotionView {
    pub promotion_id: Uuid,
    pub title: String,
    #[schema(value_type = String)]
    pub points: Decimal,
    #[schema(value_type = String)]
    pub price: Decimal,
    pub stock: u32,
    /// Units not claimed yet (at the gate when it holds the promotion).
    pub left: u32,
    pub granted: u32,
    pub starts_at: DateTime<Utc>,
    pub ends_at: DateTime<Utc>,
    pub ended_at: Option<DateTime<Utc>>,
}

fn two_places(mut value: Decimal) -> Decimal {
    value.rescale(zhihui_domain::points::POINTS_SCALE);
    value
}

impl PromotionView {
    pub(crate) fn of(state: &PromotionState, left: Option<i64>) -> PromotionView {
        PromotionView {
            promotion_id: state.promotion_id,
            title: state.spec.title.clone(),
            points: two_places(state.spec.points.as_decimal()),
            price: two_places(state.spec.price.map_or(Decimal::ZERO, |p| p.as_decimal())),
            stock: state.spec.stock,
            left: left
                .and_then(|left| u32::try_from(left.max(0)).ok())
                .unwrap_or_else(|| state.left()),
            granted: state.granted,
            starts_at: state.spec.starts_at,
            ends_at: state.spec.ends_at,
            ended_at: state.ended_at,
        }
    }
}

fn promotion_error(error: CommandError<PromotionError>) -> ApiError {
    match error {
        CommandError::Rejected(PromotionError::Unknown) => {
            ApiError::NotFound("no such promotion".into())
        }
        CommandError::Rejected(PromotionError::Invalid { field, broken }) => {
            ApiError::invalid(field, broken)
        }
        CommandError::Rejected(PromotionError::AlreadyCreated) => ApiError::Conflict {
            rule: "idempotency-key-reused",
            detail: "this Idempotency-Key created another promotion".into(),
        },
        CommandError::Rejected(PromotionError::Ended) => ApiError::Conflict {
            rule: "promotion-ended",
            detail: "the promotion has ended".into(),
        },
        CommandError::Rejected(other) => ApiError::Conflict {
            rule: "promotion-refused",
            detail: other.to_string(),
        },
        CommandError::Contended { stream, attempts } => ApiError::from(anyhow::Error::new(
            crate::platform::command::StreamContended { stream, attempts },
        )),
        CommandError::Store(error) => ApiError::from(error),
    }
}

pub(crate) fn parse_id(path: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(path).map_err(|_| ApiError::NotFound("no such promotion".into()))
}

/// Create a promotion (a points pack with a stock, a price and a window; one claim per user).
/// Send an `Idempotency-Key` to make retries safe.
#[utoipa::path(
    post, path = "/api/v1/admin/promotions", tag = "admin", security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header, description = "same key, same promotion")),
    request_body = PromotionRequest,
    responses(
        (status = 201, body = PromotionView),
        (status = 403, body = crate::http::problem::Problem),
        (status = 409, description = "`idempotency-key-reused`", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule (named)", body = crate::http::problem::Problem),
    )
)]
pub async fn create(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    body: crate::http::extract::Json<PromotionRequest>,
) -> Result<HttpResponse, ApiError> {
    let promotion_id = match crate::http::accounts::idempotency_key(&request)? {
        None => Uuid::now_v7(),
        Some(key) => promotion_id_of_key(&key),
    };
    let metadata = event_metadata(&request, admin.actor());
    let view = create_promotion(&state, &admin, promotion_id, &body, metadata).await?;
    Ok(HttpResponse::Created()
        .insert_header((
            actix_web::http::header::LOCATION,
            format!("/api/v1/admin/promotions/{promotion_id}"),
        ))
        .json(view))
}

/// The promotion id of an idempotency key (the admin pages use one per form).
pub(crate) fn promotion_id_of_key(key: &str) -> Uuid {
    Uuid::new_v5(&PROMOTION_NAMESPACE, key.as_bytes())
}

/// Create a promotion (the API and the admin pages).
pub(crate) async fn create_promotion(
    state: &AppState,
    _admin: &Admin,
    promotion_id: Uuid,
    body: &PromotionRequest,
    metadata: crate::platform::event_store::EventMetadata,
) -> Result<PromotionView, ApiError> {
    let amount = |field: &str, value: Decimal| {
        Amount::parse(value).map_err(|error| ApiError::invalid(field, error.0))
    };
    let spec = PromotionSpec {
        title: body.title.trim().to_owned(),
        points: amount("points", body.points)?,
        price: if body.price.is_zero() {
            None
        } else {
            Some(amount("price", body.price)?)
        },
        stock: body.stock,
        starts_at: body.starts_at,
        ends_at: body.ends_at,
    };
    let created = state
        .promotions
        .create(promotion_id, spec, metadata)
        .await
        .map_err(promotion_error)?;
    Ok(PromotionView::of(&created, None))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AdminPromotionView {
    #[serde(flatten)]
    pub promotion: PromotionView,
    /// Claims a consumer could not persist, with their reasons.
    #[schema(value_type = Vec<Object>)]
    pub parked: Vec<std::collections::HashMap<&'static str, String>>,
}

/// A promotion from its stream, with the claims parked for admins.
#[utoipa::path(
    get, path = "/api/v1/admin/promotions/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "promotion id")),
    responses((status = 200, body = AdminPromotionView), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn show(
    state: web::Data<AppState>,
    _admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let promotion_id = parse_id(&path)?;
    let promotion = state
        .promotions
        .load(promotion_id)
        .await?
        .ok_or_else(|| ApiError::NotFound("no such promotion".into()))?;
    let left = state
        .promotions
        .left_in_redis(promotion_id)
        .await
        .ok()
        .flatten();
    Ok(HttpResponse::Ok().json(AdminPromotionView {
        promotion: PromotionView::of(&promotion, left),
        parked: state.promotions.parked(Some(promotion_id)).await?,
    }))
}

/// End a promotion now (claims accepted before stay valid).
#[utoipa::path(
    post, path = "/api/v1/admin/promotions/{id}/end", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "promotion id")),
    responses((status = 200, body = PromotionView), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn end(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let promotion_id = parse_id(&path)?;
    let view = change_promotion(
        &state,
        &admin,
        promotion_id,
        PromotionChange::End,
        event_metadata(&request, admin.actor()),
    )
    .await?;
    Ok(HttpResponse::Ok().json(view))
}

/// What an admin changes in a running promotion.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PromotionChange {
    End,
    RaiseStock(u32),
}

/// End a promotion or raise its stock (the API and the admin pages).
pub(crate) async fn change_promotion(
    state: &AppState,
    _admin: &Admin,
    promotion_id: Uuid,
    change: PromotionChange,
    metadata: crate::platform::event_store::EventMetadata,
) -> Result<PromotionView, ApiError> {
    let at = state.clock.now();
    let command = match change {
        PromotionChange::End => PromotionCommand::End { at },
        PromotionChange::RaiseStock(by) => PromotionCommand::RaiseStock { by, at },
    };
    let changed = state
        .promotions
        .execute(promotion_id, command, metadata)
        .await
        .map_err(promotion_error)?;
    Ok(PromotionView::of(&changed, None))
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StockRequest {
    /// Units to add (at least 1; the stock stays at most 1,000,000).
    #[serde(deserialize_with = "crate::http::extract::whole::u32")]
    pub add: u32,
}

/// Raise a promotion's stock (until it ends).
#[utoipa::path(
    post, path = "/api/v1/admin/promotions/{id}/stock", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "promotion id")),
    request_body = StockRequest,
    responses(
        (status = 200, body = PromotionView),
        (status = 403, body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
        (status = 409, description = "`promotion-ended`", body = crate::http::problem::Problem),
        (status = 422, description = "`add` out of range", body = crate::http::problem::Problem),
    )
)]
pub async fn raise(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
    body: crate::http::extract::Json<StockRequest>,
) -> Result<HttpResponse, ApiError> {
    let promotion_id = parse_id(&path)?;
    let view = change_promotion(
        &state,
        &admin,
        promotion_id,
        PromotionChange::RaiseStock(body.add),
        event_metadata(&request, admin.actor()),
    )
    .await?;
    Ok(HttpResponse::Ok().json(view))
}

/// The promotions open now, with the units left.
#[utoipa::path(
    get, path = "/api/v1/promotions", tag = "promotions", security(("bearer" = [])),
    responses((status = 200, body = Vec<PromotionView>), (status = 401, body = crate::http::problem::Problem))
)]
pub async fn open(
    state: web::Data<AppState>,
    _caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(open_promotions(&state).await?))
}

/// The ids a read-model query lists (`$1` its one parameter).
async fn promotion_ids(
    state: &AppState,
    sql: &str,
    parameter: &(dyn tokio_postgres::types::ToSql + Sync),
) -> Result<Vec<Uuid>, ApiError> {
    let client = crate::platform::postgres::checkout(&state.pg_pool)
        .await
        .context("getting a connection")?;
    Ok(client
        .query(sql, &[parameter])
        .await
        .context("reading promotions")?
        .iter()
        .map(|row| row.get(0))
        .collect())
}

/// A promotion's view with what the gate says is left (its stream's count when the gate
/// cannot tell).
async fn view_with_left(state: &AppState, promotion: &PromotionState) -> PromotionView {
    let left = state
        .promotions
        .left_in_redis(promotion.promotion_id)
        .await
        .ok()
        .flatten();
    PromotionView::of(promotion, left)
}

/// The promotions open now, from their streams (the API and the pages).
pub(crate) async fn open_promotions(state: &AppState) -> Result<Vec<PromotionView>, ApiError> {
    let now = state.clock.now();
    let ids = promotion_ids(
        state,
        "SELECT promotion_id FROM promotions
          WHERE starts_at <= $1 AND $1 < ends_at AND (ended_at IS NULL OR $1 < ended_at)
          ORDER BY ends_at LIMIT 100",
        &now,
    )
    .await?;
    let mut open = Vec::new();
    for promotion_id in ids {
        // The stream says whether it is still open (the read model may trail an end).
        if let Some(promotion) = state.promotions.load(promotion_id).await?
            && promotion.open_at(now)
        {
            open.push(view_with_left(state, &promotion).await);
        }
    }
    Ok(open)
}

/// Promotions that open later (at most 20, soonest first): the pages count down to them.
pub(crate) async fn upcoming_promotions(state: &AppState) -> Result<Vec<PromotionView>, ApiError> {
    let now = state.clock.now();
    let ids = promotion_ids(
        state,
        "SELECT promotion_id FROM promotions
          WHERE $1 < starts_at AND ended_at IS NULL ORDER BY starts_at LIMIT 20",
        &now,
    )
    .await?;
    let mut upcoming = Vec::new();
    for promotion_id in ids {
        if let Some(promotion) = state.promotions.load(promotion_id).await?
            && promotion.ended_at.is_none()
        {
            upcoming.push(PromotionView::of(&promotion, None));
        }
    }
    Ok(upcoming)
}

/// Every promotion, newest first (admins; at most `limit`).
pub(crate) async fn recent_promotions(
    state: &AppState,
    limit: i64,
) -> Result<Vec<PromotionView>, ApiError> {
    let ids = promotion_ids(
        state,
        "SELECT promotion_id FROM promotions ORDER BY starts_at DESC LIMIT $1",
        &limit,
    )
    .await?;
    let mut views = Vec::new();
    for promotion_id in ids {
        if let Some(promotion) = state.promotions.load(promotion_id).await? {
            views.push(view_with_left(state, &promotion).await);
        }
    }
    Ok(views)
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ClaimAccepted {
    pub claim_id: Uuid,
    /// Always `pending`: the claim is persisted in the background; the socket hears
    /// `claim_granted` or `claim_refused`, and `GET .../claims/me` shows it.
    pub status: &'static str,
}

/// Claim a promotion: accepted at once (202) or refused with a named problem.
#[utoipa::path(
    post, path = "/api/v1/promotions/{id}/claims", tag = "promotions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "promotion id")),
    responses(
        (status = 202, body = ClaimAccepted),
        (status = 401, body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
        (status = 409, description = "`sold-out`, `already-claimed`, `not-open` (with `valid_from`, `valid_until`)", body = crate::http::problem::Problem),
    )
)]
pub async fn claim(
    state: web::Data<AppState>,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let promotion_id = parse_id(&path)?;
    let claim_id = claim_for(&state, caller.user_id(), promotion_id).await?;
    Ok(HttpResponse::Accepted().json(ClaimAccepted {
        claim_id,
        status: "pending",
    }))
}

/// Claim `promotion_id` for `user_id` at the gate (the API and the pages).
pub(crate) async fn claim_for(
    state: &AppState,
    user_id: zhihui_domain::user::UserId,
    promotion_id: Uuid,
) -> Result<Uuid, ApiError> {
    let claim_id = state
        .promotions
        .claim(user_id, promotion_id)
        .await
        .map_err(|error| match error {
            ClaimError::Unknown => ApiError::NotFound("no such promotion".into()),
            ClaimError::SoldOut => ApiError::Conflict {
                rule: "sold-out",
                detail: "the promotion is sold out".into(),
            },
            ClaimError::AlreadyClaimed => ApiError::Conflict {
                rule: "already-claimed",
                detail: "you have claimed this promotion already".into(),
            },
            ClaimError::NotOpen { starts_at, ends_at } => ApiError::Refused {
                status: StatusCode::CONFLICT,
                rule: "not-open",
                detail: format!("the promotion is open from {starts_at} until {ends_at}"),
                window: Some((starts_at, ends_at)),
            },
            ClaimError::Store(error) => ApiError::from(error),
        })?;
    Ok(claim_id)
}

/// The caller's claim on a promotion: `pending`, `granted` or `refused` (with its reason).
#[utoipa::path(
    get, path = "/api/v1/promotions/{id}/claims/me", tag = "promotions", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "promotion id")),
    responses((status = 200, body = Object), (status = 401, body = crate::http::problem::Problem), (status = 404, description = "no claim", body = crate::http::problem::Problem))
)]
pub async fn my_claim(
    state: web::Data<AppState>,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let promotion_id = parse_id(&path)?;
    let claim = state
        .promotions
        .my_claim(caller.user_id(), promotion_id)
        .await?
        .ok_or_else(|| ApiError::NotFound("no claim on this promotion".into()))?;
    Ok(HttpResponse::Ok().json(claim))
}
