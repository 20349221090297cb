//! `/api/v1/me/keys` and `/api/v1/admin/users/{id}/keys`: API keys for programs. A key is shown
//! once, in the answer that makes it; lists show names, scopes and use, never keys.

use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::api_key::KEY_NAME_LENGTH_MAX;
use zhihui_domain::api_key::Scope;
use zhihui_domain::rule::{Broken, Rule};
use zhihui_domain::user::{ApiKey, UserError, UserId};

use crate::http::extract::{Admin, Authenticated};
use crate::http::{ApiError, event_metadata};
use crate::identity::api_keys::{KeyView, NewKey};
use crate::identity::users::RegisterError;
use crate::state::AppState;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    /// 1 to 64 characters: what the key is for.
    pub name: String,
    /// At least one of `tasks:write`, `tasks:read`, `account:read`, `codes:redeem`, `webhooks`,
    /// `gallery:write`, and `admin` for an admin's key.
    pub scopes: Vec<String>,
    /// When the key stops working; never when absent.
    pub expires_at: Option<DateTime<Utc>>,
    /// Requests a minute (default `api_keys.requests_per_minute`).
    #[serde(
        default,
        deserialize_with = "crate::http::extract::whole::optional_u32"
    )]
    pub requests_per_minute: Option<u32>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CreatedKey {
    /// The key: shown this once. Send it as `Authorization: Bearer <key>`.
    pub key: String,
    pub key_id: Uuid,
    pub name: String,
    #[schema(value_type = Vec<String>)]
    pub scopes: Vec<Scope>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub requests_per_minute: u32,
}

fn key_error(error: RegisterError) -> ApiError {
    match error {
        RegisterError::Rejected(UserError::KeyNotFound) => ApiError::NotFound("no such key".into()),
        RegisterError::Rejected(UserError::NotRegistered) => {
            ApiError::NotFound("no such user".into())
        }
        RegisterError::Rejected(error @ UserError::TooManyKeys) => ApiError::Conflict {
            rule: "too-many-keys",
            detail: error.to_string(),
        },
        RegisterError::Rejected(UserError::InvalidKeyName) => ApiError::invalid(
            "name",
            Broken::new(Rule::LengthBetween)
                .with("min", 1)
                .with("max", KEY_NAME_LENGTH_MAX),
        ),
        RegisterError::Rejected(UserError::KeyNameNotOneLine) => {
            ApiError::invalid_by("name", Rule::OneLine)
        }
        RegisterError::Rejected(UserError::NoScopes) => {
            ApiError::invalid_by("scopes", Rule::AtLeastOneScope)
        }
        RegisterError::Rejected(UserError::AdminScopeForbidden) => {
            ApiError::invalid_by("scopes", Rule::AdminScope)
        }
        RegisterError::Rejected(UserError::ExpiryInPast) => {
            ApiError::invalid_by("expires_at", Rule::InFuture)
        }
        RegisterError::Rejected(UserError::NoRequests) => {
            ApiError::invalid_by("requests_per_minute", Rule::AtLeastOne)
        }
        RegisterError::Rejected(error @ UserError::KeyIdTaken(_)) => ApiError::Conflict {
            rule: "idempotency-key-reused",
            detail: error.to_string(),
        },
        other => crate::http::auth::register_error(other),
    }
}

fn parse_request(state: &AppState, body: CreateKeyRequest) -> Result<NewKey, ApiError> {
    let mut scopes = Vec::with_capacity(body.scopes.len());
    for text in &body.scopes {
        scopes.push(Scope::parse(text).ok_or_else(|| {
            ApiError::invalid(
                "scopes",
                Broken::new(Rule::NotScope)
                    .with("value", format!("{text:?}"))
                    .with("allowed", Scope::ALL.map(Scope::as_str).join(", ")),
            )
        })?);
    }
    if let Some(rate) = body.requests_per_minute
        && !(1..=state.api_keys.rate_max).contains(&rate)
    {
        return Err(ApiError::invalid(
            "requests_per_minute",
            Broken::new(Rule::Between)
                .with("min", 1)
                .with("max", state.api_keys.rate_max),
        ));
    }
    Ok(NewKey {
        name: body.name,
        scopes,
        expires_at: body.expires_at,
        requests_per_minute: body.requests_per_minute,
    })
}

fn created(key: String, record: ApiKey) -> CreatedKey {
    CreatedKey {
        key,
        key_id: record.key_id,
        name: record.name,
        scopes: record.scopes,
        created_at: record.created_at,
        expires_at: record.expires_at,
        requests_per_minute: record.requests_per_minute,
    }
}

/// Make `user_id` a key (the caller's own, or any user's for an admin): the API and the
/// settings page.
pub(crate) async fn create_key(
    state: &AppState,
    user_id: UserId,
    body: CreateKeyRequest,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<CreatedKey, ApiError> {
    let new_key = parse_request(state, body)?;
    let (key, record) = state
        .api_keys
        .create(user_id, new_key, metadata)
        .await
        .map_err(key_error)?;
    Ok(created(key, record))
}

/// Revoke one of `user_id`'s keys (the API and the settings page).
pub(crate) async fn revoke_key(
    state: &AppState,
    user_id: UserId,
    key_id: Uuid,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<(), ApiError> {
    state
        .api_keys
        .revoke(user_id, key_id, metadata)
        .await
        .map_err(key_error)?;
    Ok(())
}

async fn create_for(
    state: &AppState,
    request: &HttpRequest,
    actor: String,
    user_id: UserId,
    body: CreateKeyRequest,
) -> Result<HttpResponse, ApiError> {
    let created = create_key(state, user_id, body, &event_metadata(request, actor)).await?;
    Ok(HttpResponse::Created().json(created))
}

/// Make an API key for yourself (with a person's session). The key is in this answer only.
#[utoipa::path(
    post, operation_id = "create_key", path = "/api/v1/me/keys", tag = "keys", security(("bearer" = [])),
    request_body = CreateKeyRequest,
    responses(
        (status = 201, body = CreatedKey),
        (status = 403, description = "`scope-missing`: a key cannot make keys", body = crate::http::problem::Problem),
        (status = 409, description = "`too-many-keys`", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule (named)", body = crate::http::problem::Problem),
    )
)]
pub async fn create(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<CreateKeyRequest>,
) -> Result<HttpResponse, ApiError> {
    create_for(
        &state,
        &request,
        caller.actor(),
        caller.user_id(),
        body.into_inner(),
    )
    .await
}

/// Your keys (never the keys themselves): names, scopes, when made, last used, expiry.
#[utoipa::path(
    get, operation_id = "list_keys", path = "/api/v1/me/keys", tag = "keys", security(("bearer" = [])),
    responses((status = 200, body = [KeyView]))
)]
pub async fn list(
    state: web::Data<AppState>,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(state.api_keys.list(caller.user_id()).await?))
}

fn parse_key_id(raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::NotFound("no such key".into()))
}

/// Revoke one of your keys: refused on every instance from this answer on.
#[utoipa::path(
    delete, operation_id = "revoke_key", path = "/api/v1/me/keys/{key_id}", tag = "keys", security(("bearer" = [])),
    params(("key_id" = Uuid, Path, description = "key id")),
    responses((status = 204, description = "revoked"), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn revoke(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let key_id = parse_key_id(&path)?;
    revoke_key(
        &state,
        caller.user_id(),
        key_id,
        &event_metadata(&request, caller.actor()),
    )
    .await?;
    Ok(HttpResponse::NoContent().finish())
}

/// Make a key for a user (admins).
#[utoipa::path(
    post, operation_id = "admin_create_key", path = "/api/v1/admin/users/{id}/keys", tag = "admin", security(("bearer" = []), ("api_key" = ["admin"])),
    params(("id" = Uuid, Path, description = "user id")),
    request_body = CreateKeyRequest,
    responses(
        (status = 201, body = CreatedKey),
        (status = 403, body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
        (status = 409, description = "`too-many-keys`", body = crate::http::problem::Problem),
        (status = 422, body = crate::http::problem::Problem),
    )
)]
pub async fn admin_create(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
    body: crate::http::extract::Json<CreateKeyRequest>,
) -> Result<HttpResponse, ApiError> {
    let user_id = crate::http::users::parse_user_id(&path)?;
    create_for(&state, &request, admin.actor(), user_id, body.into_inner()).await
}

/// A user's keys (admins).
#[utoipa::path(
    get, operation_id = "admin_list_keys", path = "/api/v1/admin/users/{id}/keys", tag = "admin", security(("bearer" = []), ("api_key" = ["admin"])),
    params(("id" = Uuid, Path, description = "user id")),
    responses((status = 200, body = [KeyView]), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn admin_list(
    state: web::Data<AppState>,
    _admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let user_id = crate::http::users::parse_user_id(&path)?;
    Ok(HttpResponse::Ok().json(state.api_keys.list(user_id).await?))
}

/// Revoke a user's key (admins).
#[utoipa::path(
    delete, operation_id = "admin_revoke_key", path = "/api/v1/admin/users/{id}/keys/{key_id}", tag = "admin", security(("bearer" = []), ("api_key" = ["admin"])),
    params(("id" = Uuid, Path, description = "user id"), ("key_id" = Uuid, Path, description = "key id")),
    responses((status = 204, description = "revoked"), (status = 403, body = crate::http::problem::Problem), (status = 404, body = crate::http::problem::Problem))
)]
pub async fn admin_revoke(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (user, key) = path.into_inner();
    let user_id = crate::http::users::parse_user_id(&user)?;
    let key_id = parse_key_id(&key)?;
    state
        .api_keys
        .revoke(user_id, key_id, &event_metadata(&request, admin.actor()))
        .await
        .map_err(key_error)?;
    Ok(HttpResponse::NoContent().finish())
}
