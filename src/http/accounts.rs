//! `/api/v1/account*` (own balance and ledger: the read model, plus the account stream's events
//! it has not applied yet, so a user reads their own writes at once) and
//! `/api/v1/admin/accounts/{user}/grants`, `/api/v1/admin/projections`.

use actix_web::{HttpRequest, HttpResponse, web};
use anyhow::Context;
use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountCommand, AccountError, AccountEvent, account_stream};
use zhihui_domain::points::Amount;
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::user::UserId;

use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::platform::command::CommandError;
use crate::platform::event_store::{Direction, EventStore, ReadFrom, RecordedEvent};
use crate::state::AppState;

/// Most ledger entries per page: one screen, and a bounded query.
pub const LEDGER_PAGE_MAX: i64 = 100;
/// Ledger entries per page when the client does not say.
pub const LEDGER_PAGE_DEFAULT: i64 = 20;
/// Longest grant reason: a sentence for the audit log, not a document.
pub const GRANT_REASON_LENGTH_MAX: usize = 200;
/// Longest `Idempotency-Key` accepted.
pub const IDEMPOTENCY_KEY_LENGTH_MAX: usize = 200;

/// Namespace of operation ids derived from `Idempotency-Key` headers.
const IDEMPOTENCY_NAMESPACE: Uuid = Uuid::from_u128(0x7a68_6968_7569_4000_8000_6964_656d_706f);

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct BalanceView {
    /// Decimal string with two places, e.g. `"90.00"`.
    #[schema(value_type = String, example = "90.00")]
    pub available: Decimal,
    #[schema(value_type = String, example = "10.00")]
    pub frozen: Decimal,
    pub updated_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LedgerEntryView {
    pub occurred_at: DateTime<Utc>,
    /// grant, freeze, deduct, return, charge, refund, redeem_code, check_in_bonus, promotion.
    pub kind: String,
    #[schema(value_type = String)]
    pub amount: Decimal,
    #[schema(value_type = String)]
    pub available_after: Decimal,
    #[schema(value_type = String)]
    pub frozen_after: Decimal,
    pub task_id: Option<Uuid>,
    pub operation_id: Option<Uuid>,
    pub reason: Option<String>,
    pub correlation_id: Uuid,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LedgerPage {
    pub entries: Vec<LedgerEntryView>,
    /// Pass as `cursor` for the next (older) page; absent on the last page.
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct LedgerQuery {
    /// 1 to 100, default 20.
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    #[param(pattern = "^[0-9]{1,18}$")]
    pub cursor: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GrantRequest {
    /// Positive, at most two decimal places; a string (`"100"`) or a number.
    #[schema(value_type = String, example = "100")]
    #[serde(deserialize_with = "crate::http::extract::decimal::plain_decimal")]
    pub amount: Decimal,
    pub reason: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct GrantResponse {
    pub operation_id: Uuid,
    /// False when this was a repeat of an earlier request with the same `Idempotency-Key`.
    pub granted_now: bool,
    #[schema(value_type = String)]
    pub available: Decimal,
    #[schema(value_type = String)]
    pub frozen: Decimal,
}

/// The caller's balance.
#[utoipa::path(
    get, path = "/api/v1/account", tag = "account", security(("bearer" = [])),
    responses((status = 200, body = BalanceView), (status = 401, body = crate::http::problem::Problem))
)]
pub async fn balance(
    state: web::Data<AppState>,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(balance_of(&state, caller.user_id()).await?))
}

/// A user's balance from their account stream's last event (each carries the balance after it),
/// not the read model: a user reads their own writes even while the projection lags, on any
/// instance. The web pages show the same.
pub(crate) async fn balance_of(state: &AppState, user_id: UserId) -> Result<BalanceView, ApiError> {
    let last = state
        .event_store
        .read_stream(
            &account_stream(user_id),
            Direction::Backwards,
            ReadFrom::End,
            1,
        )
        .await
        .context("reading the account's last event")?;
    let view = match last.first() {
        Some(recorded) => {
            let event = account_event(recorded)?;
            let balance = event.balance_after();
            BalanceView {
                available: two_places(balance.available.as_decimal()),
                frozen: two_places(balance.frozen.as_decimal()),
                updated_at: Some(event.at()),
            }
        }
        None => BalanceView {
            available: Decimal::new(0, 2),
            frozen: Decimal::new(0, 2),
            updated_at: None,
        },
    };
    Ok(view)
}

/// Points as the read model's `numeric(20, 2)` shows them (a stored zero may have no places).
fn two_places(mut value: Decimal) -> Decimal {
    value.rescale(zhihui_domain::points::POINTS_SCALE);
    value
}

fn account_event(recorded: &RecordedEvent) -> anyhow::Result<AccountEvent> {
    AccountEvent::from_stored(
        &recorded.event_type,
        recorded.schema_version,
        &recorded.payload,
    )
    .with_context(|| format!("decoding event {} of {}", recorded.id, recorded.stream))
}

/// A ledger row from an account event the projection has not applied yet (the same columns the
/// `ledger` projection writes).
fn ledger_entry_of(recorded: &RecordedEvent) -> anyhow::Result<(i64, LedgerEntryView)> {
    let event = account_event(recorded)?;
    let after = event.balance_after();
    let is_hold = zhihui_projections::accounts::is_hold(&event);
    let view = LedgerEntryView {
        occurred_at: event.at(),
        kind: zhihui_projections::accounts::kind_of(&event).to_owned(),
        amount: two_places(event.amount().as_decimal()),
        available_after: two_places(after.available.as_decimal()),
        frozen_after: two_places(after.frozen.as_decimal()),
        task_id: is_hold.then(|| event.reference_id()),
        operation_id: (!is_hold).then(|| event.reference_id()),
        reason: zhihui_projections::accounts::reason_of(&event),
        correlation_id: recorded.metadata.correlation_id,
    };
    Ok((i64::try_from(recorded.stream_version)?, view))
}

/// The caller's ledger, newest first.
#[utoipa::path(
    get, path = "/api/v1/account/ledger", tag = "account", security(("bearer" = [])),
    params(LedgerQuery),
    responses((status = 200, body = LedgerPage), (status = 401, body = crate::http::problem::Problem), (status = 422, body = crate::http::problem::Problem))
)]
pub async fn ledger(
    state: web::Data<AppState>,
    caller: Authenticated,
    query: crate::http::extract::Query<LedgerQuery>,
) -> Result<HttpResponse, ApiError> {
    let page = ledger_page(
        &state,
        caller.user_id(),
        query.limit,
        query.cursor.as_deref(),
    )
    .await?;
    Ok(HttpResponse::Ok().json(page))
}

/// A page of `user_id`'s ledger, newest first (the caller's own, or any user's for admins).
pub(crate) async fn ledger_page(
    state: &AppState,
    user_id: UserId,
    limit: Option<i64>,
    cursor: Option<&str>,
) -> Result<LedgerPage, ApiError> {
    let limit = limit.unwrap_or(LEDGER_PAGE_DEFAULT);
    if !(1..=LEDGER_PAGE_MAX).contains(&limit) {
        return Err(ApiError::invalid(
            "limit",
            Broken::new(Rule::Between)
                .with("min", 1)
                .with("max", LEDGER_PAGE_MAX),
        ));
    }
    // The cursor is the stream version of the last entry shown; entries before it come next.
    let before: i64 = match cursor {
        None => i64::MAX,
        // A version this server handed out: digits only, no sign (`-1` or `+5` were never one).
        Some(cursor) => cursor
            .parse::<u64>()
            .ok()
            .filter(|_| cursor.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|version| i64::try_from(version).ok())
            .ok_or_else(|| ApiError::invalid_by("cursor", Rule::Cursor))?,
    };
    let client = crate::platform::postgres::checkout(&state.pg_pool)
        .await
        .context("getting a connection")?;
    // How far the projection got first, then only rows up to there: a batch committed between
    // the two reads must not leave a gap between the rows and the stream's tail below.
    let projected_version: Option<i64> = crate::platform::postgres::query_opt_cached(
        &client,
        "SELECT stream_version FROM accounts WHERE user_id = $1",
        &[&user_id.as_uuid()],
    )
    .await
    .context("reading how far the ledger is projected")?
    .map(|row| row.get(0));
    let rows = match projected_version {
        None => Vec::new(),
        Some(projected) => crate::platform::postgres::query_cached(
            &client,
            "SELECT occurred_at, kind, amount, available_after, frozen_after, task_id,
                    operation_id, reason, correlation_id, stream_version
               FROM ledger_entries
              WHERE user_id = $1 AND stream_version < $2 AND stream_version <= $3
              ORDER BY stream_version DESC LIMIT $4",
            &[&user_id.as_uuid(), &before, &projected, &(limit + 1)],
        )
        .await
        .context("reading the ledger")?,
    };
    drop(client);
    // The page's newest entries may not be projected yet: read them from the stream (at most a
    // page, newest first), so a user sees their own acknowledged movements at once.
    let newest = if before == i64::MAX {
        ReadFrom::End
    } else {
        ReadFrom::Version(u64::try_from(before.saturating_sub(1)).unwrap_or(0))
    };
    let mut entries: Vec<(i64, LedgerEntryView)> = Vec::new();
    if before > 0 {
        let tail = state
            .event_store
            .read_stream(
                &account_stream(user_id),
                Direction::Backwards,
                newest,
                usize::try_from(limit + 1).unwrap_or(1),
            )
            .await
            .context("reading the account's newest events")?;
        for recorded in &tail {
            let version = i64::try_from(recorded.stream_version).context("stream version")?;
            if projected_version.is_some_and(|projected| version <= projected) {
                break;
            }
            entries.push(ledger_entry_of(recorded)?);
        }
    }
    entries.extend(rows.iter().map(|row| {
        (
            row.get::<_, i64>(9),
            LedgerEntryView {
                occurred_at: row.get(0),
                kind: row.get(1),
                amount: row.get(2),
                available_after: row.get(3),
                frozen_after: row.get(4),
                task_id: row.get(5),
                operation_id: row.get(6),
                reason: row.get(7),
                correlation_id: row.get(8),
            },
        )
    }));
    let limit = usize::try_from(limit).unwrap_or(0);
    let has_more = entries.len() > limit;
    entries.truncate(limit);
    let next_cursor = if has_more {
        entries.last().map(|(version, _)| version.to_string())
    } else {
        None
    };
    let entries = entries.into_iter().map(|(_, entry)| entry).collect();
    Ok(LedgerPage {
        entries,
        next_cursor,
    })
}

/// The `Idempotency-Key` header, checked: `None` when absent.
pub fn idempotency_key(request: &HttpRequest) -> Result<Option<String>, ApiError> {
    let Some(value) = request.headers().get("idempotency-key") else {
        return Ok(None);
    };
    // Visible ASCII only: no space inside a key (a header's ends are trimmed in transit, so a
    // key with spaces would not survive every proxy unchanged).
    let key = value.to_str().unwrap_or("");
    if key.is_empty()
        || key.len() > IDEMPOTENCY_KEY_LENGTH_MAX
        || !key.bytes().all(|byte| byte.is_ascii_graphic())
    {
        return Err(ApiError::invalid(
            "Idempotency-Key",
            Broken::new(Rule::VisibleAscii).with("max", IDEMPOTENCY_KEY_LENGTH_MAX),
        ));
    }
    Ok(Some(key.to_owned()))
}

/// The operation id of a request: derived from its `Idempotency-Key` (so a retry finds the same
/// operation), or fresh.
pub fn operation_id(request: &HttpRequest, scope: &str) -> Result<Uuid, ApiError> {
    Ok(match idempotency_key(request)? {
        None => Uuid::now_v7(),
        Some(key) => operation_id_of_key(scope, &key),
    })
}

/// The operation id of an idempotency key in `scope` (the admin pages use one key per form).
pub fn operation_id_of_key(scope: &str, key: &str) -> Uuid {
    Uuid::new_v5(&IDEMPOTENCY_NAMESPACE, format!("{scope}:{key}").as_bytes())
}

pub fn account_error(error: CommandError<AccountError>) -> ApiError {
    match error {
        CommandError::Rejected(error @ AccountError::InsufficientPoints { .. }) => {
            ApiError::Conflict {
                rule: "insufficient-points",
                detail: error.to_string(),
            }
        }
        CommandError::Rejected(error @ AccountError::OperationIdReused(_)) => ApiError::Conflict {
            rule: "idempotency-key-reused",
            detail: format!("{error}: this Idempotency-Key was used for another request"),
        },
        CommandError::Rejected(error) => ApiError::Conflict {
            rule: "account-rule",
            detail: error.to_string(),
        },
        CommandError::Contended { .. } => ApiError::Unavailable {
            dependencies: vec!["event-store".into()],
        },
        CommandError::Store(error) => error.into(),
    }
}

/// Grant points to a user (admins). Send an `Idempotency-Key` header to make retries safe.
#[utoipa::path(
    post, path = "/api/v1/admin/accounts/{user}/grants", tag = "admin", security(("bearer" = [])),
    params(
        ("user" = Uuid, Path, description = "user id"),
        ("Idempotency-Key" = Option<String>, Header, description = "same key, same grant: a retry grants nothing more"),
    ),
    request_body = GrantRequest,
    responses(
        (status = 201, body = GrantResponse),
        (status = 403, description = "`admin-only`", body = crate::http::problem::Problem),
        (status = 404, description = "no such user", body = crate::http::problem::Problem),
        (status = 409, description = "`idempotency-key-reused` with another amount", body = crate::http::problem::Problem),
        (status = 422, description = "`amount` or `reason` breaks its rule", body = crate::http::problem::Problem),
    )
)]
pub async fn grant(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
    body: crate::http::extract::Json<GrantRequest>,
) -> Result<HttpResponse, ApiError> {
    let user_id = crate::http::users::parse_user_id(&path)?;
    let operation_id = operation_id(&request, &format!("grant:{user_id}"))?;
    let granted = grant_points(
        &state,
        &admin,
        user_id,
        &body,
        operation_id,
        event_metadata(&request, admin.actor()),
    )
    .await?;
    Ok(HttpResponse::Created().json(granted))
}

/// Grant points to `user_id` as `admin` (the API's route and the admin pages).
pub(crate) async fn grant_points(
    state: &AppState,
    // Only an admin's request can call this (the type is the proof).
    _admin: &Admin,
    user_id: UserId,
    body: &GrantRequest,
    operation_id: Uuid,
    metadata: crate::platform::event_store::EventMetadata,
) -> Result<GrantResponse, ApiError> {
    let amount =
        Amount::parse(body.amount).map_err(|error| ApiError::invalid("amount", error.0))?;
    let reason = body.reason.trim();
    if zhihui_domain::text::is_blank(reason) || reason.chars().count() > GRANT_REASON_LENGTH_MAX {
        return Err(ApiError::invalid(
            "reason",
            Broken::new(Rule::LengthBetween)
                .with("min", 1)
                .with("max", GRANT_REASON_LENGTH_MAX),
        ));
    }
    zhihui_domain::text::refuse_controls(reason, false)
        .map_err(|broken| ApiError::invalid("reason", broken))?;
    if state.users.get(user_id).await?.is_none() {
        return Err(ApiError::NotFound("no such user".into()));
    }
    let command = AccountCommand::Grant {
        operation_id,
        amount,
        reason: reason.to_owned(),
        at: state.clock.now(),
    };
    let handled = state
        .accounts
        .execute(&account_stream(user_id), command, metadata)
        .await
        .map_err(account_error)?;
    let balance = handled.state_after.balance;
    let granted_now = !handled.new_events.is_empty();
    if granted_now {
        // A hint for the user's open pages; the ledger is the truth.
        let envelope = crate::platform::notify::Envelope::Credited {
            user_id: user_id.as_uuid(),
            amount: two_places(amount.as_decimal()).to_string(),
            reason: reason.to_owned(),
        };
        if let Err(error) = state.notifier.publish(&envelope).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "credit not announced");
        }
    }
    Ok(GrantResponse {
        operation_id,
        granted_now,
        available: two_places(balance.available.as_decimal()),
        frozen: two_places(balance.frozen.as_decimal()),
    })
}

/// Where each projection stands (admins).
#[utoipa::path(
    get, path = "/api/v1/admin/projections", tag = "admin", security(("bearer" = [])),
    responses((status = 200, body = [crate::platform::projector::ProjectionStatus]), (status = 403, body = crate::http::problem::Problem))
)]
pub async fn projections(
    state: web::Data<AppState>,
    _admin: Admin,
) -> Result<HttpResponse, ApiError> {
    let mut statuses = Vec::new();
    for projection in zhihui_projections::ProjectionName::ALL {
        let mut status =
            crate::platform::projector::stored_status(&state.pg_pool, projection.as_str()).await?;
        let here = state
            .projection_statuses
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(projection.as_str())
            .cloned();
        if let Some(here) = here {
            status.leader_here = here.leader_here;
        }
        statuses.push(status);
    }
    Ok(HttpResponse::Ok().json(statuses))
}
