//! Daily check-in (`/api/v1/checkins`) and the daily active users for admins
//! (`/api/v1/admin/stats/active-users`).

use actix_web::{HttpRequest, HttpResponse, web};
use chrono::NaiveDate;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use zhihui_domain::rule::{Broken, Rule};

use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::points::checkins::parse_month;
use crate::state::AppState;

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CheckInResponse {
    /// The calendar day checked in (the platform's day, UTC+8 by default).
    pub day: NaiveDate,
    /// Consecutive days ending with `day`.
    pub streak: u32,
    #[schema(value_type = String, example = "5.00")]
    pub bonus: Decimal,
    /// False when today was checked in before (nothing credited again).
    pub checked_in_now: bool,
    #[schema(value_type = String)]
    pub available: Decimal,
    #[schema(value_type = String)]
    pub frozen: Decimal,
}

fn two_places(mut value: Decimal) -> Decimal {
    value.rescale(zhihui_domain::points::POINTS_SCALE);
    value
}

/// Check in for today: the day's bonus is credited once, however often this is called.
#[utoipa::path(
    post, path = "/api/v1/checkins", tag = "account", security(("bearer" = [])),
    responses(
        (status = 200, body = CheckInResponse),
        (status = 401, body = crate::http::problem::Problem),
    )
)]
pub async fn check_in(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    let done = state
        .checkins
        .check_in(caller.user_id(), &event_metadata(&request, caller.actor()))
        .await?;
    let balance = done.account.balance;
    Ok(HttpResponse::Ok().json(CheckInResponse {
        day: done.day,
        streak: done.streak,
        bonus: two_places(done.bonus.as_decimal()),
        checked_in_now: done.checked_in_now,
        available: two_places(balance.available.as_decimal()),
        frozen: two_places(balance.frozen.as_decimal()),
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct MonthQuery {
    /// `YYYY-MM`; this month when absent.
    #[param(pattern = "^[0-9]{4}-(0[1-9]|1[0-2])$")]
    pub month: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MonthResponse {
    /// `YYYY-MM`.
    pub month: String,
    pub today: NaiveDate,
    /// The days of the month checked in, in order.
    pub days: Vec<NaiveDate>,
    /// Consecutive days ending today, or yesterday while today is not checked in yet.
    pub streak: u32,
    pub checked_in_today: bool,
}

/// One month of the caller's check-ins, and the current streak.
#[utoipa::path(
    get, path = "/api/v1/checkins", tag = "account", security(("bearer" = [])),
    params(MonthQuery),
    responses(
        (status = 200, body = MonthResponse),
        (status = 401, body = crate::http::problem::Problem),
        (status = 422, description = "`month` is not `YYYY-MM`", body = crate::http::problem::Problem),
    )
)]
pub async fn month(
    state: web::Data<AppState>,
    caller: Authenticated,
    query: crate::http::extract::Query<MonthQuery>,
) -> Result<HttpResponse, ApiError> {
    let month = match &query.month {
        None => state.checkins.today(),
        Some(text) => parse_month(text).ok_or_else(|| {
            ApiError::invalid(
                "month",
                Broken::new(Rule::Month).with("value", format!("{text:?}")),
            )
        })?,
    };
    let view = state.checkins.month(caller.user_id(), month).await?;
    Ok(HttpResponse::Ok().json(MonthResponse {
        month: view.month.format("%Y-%m").to_string(),
        today: view.today,
        days: view.days,
        streak: view.streak,
        checked_in_today: view.checked_in_today,
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct RangeQuery {
    /// First day (`YYYY-MM-DD`); six days before `to` when absent.
    pub from: Option<String>,
    /// Last day (`YYYY-MM-DD`, included); today when absent.
    pub to: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DayCount {
    pub day: NaiveDate,
    /// Estimated (HyperLogLog, about 0.8 % standard error).
    pub active_users: u64,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ActiveUsersResponse {
    pub from: NaiveDate,
    pub to: NaiveDate,
    pub days: Vec<DayCount>,
    /// Distinct users over the whole range (not the sum of the days).
    pub distinct_users: u64,
}

fn parse_day(field: &str, text: &str) -> Result<NaiveDate, ApiError> {
    text.parse().map_err(|_| {
        ApiError::invalid(
            field,
            Broken::new(Rule::Day).with("value", format!("{text:?}")),
        )
    })
}

/// The range a report asks for, checked ([`crate::identity::active_users::check_range`]).
fn report_range(
    from: Option<&str>,
    to: Option<&str>,
    today: NaiveDate,
) -> Result<(NaiveDate, NaiveDate), ApiError> {
    let to = to
        .map(|to| parse_day("to", to))
        .transpose()?
        .unwrap_or(today);
    let from = match from {
        Some(from) => parse_day("from", from)?,
        None => to - chrono::Duration::days(6),
    };
    crate::identity::active_users::check_range(from, to)
        .map_err(|(field, broken)| ApiError::invalid(field, broken))?;
    Ok((from, to))
}

/// Daily active users: each day's count and the distinct users over the range.
#[utoipa::path(
    get, path = "/api/v1/admin/stats/active-users", tag = "admin", security(("bearer" = [])),
    params(RangeQuery),
    responses(
        (status = 200, body = ActiveUsersResponse),
        (status = 401, body = crate::http::problem::Problem),
        (status = 403, body = crate::http::problem::Problem),
        (status = 422, description = "`from` or `to` is not a day, `from` is after `to`, or the range is over 400 days", body = crate::http::problem::Problem),
    )
)]
pub async fn active_users(
    state: web::Data<AppState>,
    _admin: Admin,
    query: crate::http::extract::Query<RangeQuery>,
) -> Result<HttpResponse, ApiError> {
    let (from, to) = report_range(
        query.from.as_deref(),
        query.to.as_deref(),
        state.active_users.today(),
    )?;
    let report = state.active_users.report(from, to).await?;
    Ok(HttpResponse::Ok().json(ActiveUsersResponse {
        from,
        to,
        days: report
            .days
            .into_iter()
            .map(|(day, active_users)| DayCount { day, active_users })
            .collect(),
        distinct_users: report.distinct,
    }))
}
