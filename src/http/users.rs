//! `/api/v1/me`, `/api/v1/users/{id}` and `/api/v1/admin/users/*`: profiles, password and phone
//! changes, roles.

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use uuid::Uuid;
use zhihui_domain::user::{DisplayName, RegisteredUser, Role, UserCommand, UserError, UserId};

use crate::http::auth::{UserView, parse_password, parse_phone, register_error, verify_code};
use crate::http::extract::{Admin, Authenticated, ensure_owner};
use crate::http::{ApiError, event_metadata};
use crate::identity::users::RegisterError;
use crate::state::AppState;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangePasswordRequest {
    pub current_password: String,
    /// 8 to 128 characters, not only spaces.
    #[schema(min_length = 8, max_length = 128, pattern = "\\S")]
    pub new_password: String,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BindPhoneRequest {
    pub phone: String,
    /// A code sent to that phone by `POST /api/v1/auth/code`.
    pub code: String,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DisplayNameRequest {
    /// The name others see on works, likes and your page: 1 to 20 characters in any language,
    /// one line, without `#`. Empty: none (your username, or a short id, is shown).
    #[schema(max_length = 20, example = "西湖边的画室")]
    pub display_name: String,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangeRoleRequest {
    /// `user` or `admin`.
    #[schema(value_type = String, example = "admin", pattern = "^(user|admin)$")]
    pub role: Role,
}

pub(crate) fn parse_user_id(raw: &str) -> Result<UserId, ApiError> {
    // A malformed id names no user: 404 like any other unknown id.
    Uuid::parse_str(raw)
        .map(UserId::from_uuid)
        .map_err(|_| ApiError::NotFound("no such user".into()))
}

async fn existing_user(state: &AppState, user_id: UserId) -> Result<RegisteredUser, ApiError> {
    state
        .users
        .get(user_id)
        .await?
        .ok_or_else(|| ApiError::NotFound("no such user".into()))
}

/// The caller's own profile.
#[utoipa::path(
    get, path = "/api/v1/me", tag = "users", security(("bearer" = [])),
    responses(
        (status = 200, body = UserView),
        (status = 401, description = "`missing-token` or `invalid-token`", body = crate::http::problem::Problem),
    )
)]
pub async fn me(
    state: web::Data<AppState>,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    let user = existing_user(&state, caller.user_id()).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// A user's profile: only one's own; any other id answers 404.
#[utoipa::path(
    get, path = "/api/v1/users/{id}", tag = "users", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "user id")),
    responses(
        (status = 200, body = UserView),
        (status = 401, body = crate::http::problem::Problem),
        (status = 404, description = "no such user, or not the caller", body = crate::http::problem::Problem),
    )
)]
pub async fn user(
    state: web::Data<AppState>,
    caller: Authenticated,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let user_id = parse_user_id(&path)?;
    ensure_owner(&caller, user_id, "user")?;
    let user = existing_user(&state, user_id).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// Change one's password. Every session of the user ends, this one included.
#[utoipa::path(
    put, path = "/api/v1/me/password", tag = "users", security(("bearer" = [])),
    request_body = ChangePasswordRequest,
    responses(
        (status = 204, description = "changed; log in again"),
        (status = 401, description = "`wrong-credentials`: the current password is wrong", body = crate::http::problem::Problem),
        (status = 409, description = "`user-rule`: a phone-only user has no password", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule; `new_password` the same as the current one breaks `password_unchanged`", body = crate::http::problem::Problem),
    )
)]
pub async fn change_password(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<ChangePasswordRequest>,
) -> Result<HttpResponse, ApiError> {
    let metadata = event_metadata(&request, caller.actor());
    change_password_of(&state, caller.user_id(), &body, &metadata).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// Change `user_id`'s password, proven by the current one; every session ends (the API and the
/// settings page).
pub(crate) async fn change_password_of(
    state: &AppState,
    user_id: UserId,
    body: &ChangePasswordRequest,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<(), ApiError> {
    let new_password = parse_password("new_password", &body.new_password)?;
    // Taken, it would end every session for nothing.
    if body.new_password == body.current_password {
        return Err(ApiError::invalid_by(
            "new_password",
            zhihui_domain::rule::Rule::PasswordUnchanged,
        ));
    }
    let user = existing_user(state, user_id).await?;
    if !state
        .passwords
        .verify(&body.current_password, user.password_hash.as_ref())
        .await?
    {
        return Err(ApiError::Unauthorized {
            rule: "wrong-credentials",
            detail: "current_password is wrong".into(),
        });
    }
    crate::http::auth::set_password(state, user_id, &new_password, metadata).await
}

/// Bind a phone number to one's account, proven by a code sent to it.
#[utoipa::path(
    post, path = "/api/v1/me/phone", tag = "users", security(("bearer" = [])),
    request_body = BindPhoneRequest,
    responses(
        (status = 200, body = UserView),
        (status = 401, description = "`wrong-code` or `code-expired`", body = crate::http::problem::Problem),
        (status = 409, description = "`phone-taken` or `phone-already-bound`", body = crate::http::problem::Problem),
        (status = 429, description = "`phone-locked`", body = crate::http::problem::Problem),
    )
)]
pub async fn bind_phone(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<BindPhoneRequest>,
) -> Result<HttpResponse, ApiError> {
    let metadata = event_metadata(&request, caller.actor());
    let user = bind_phone_of(&state, caller.user_id(), &body, &metadata).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// Bind `body.phone` to `user_id`, proven by the code sent to it (the API and the settings
/// page).
pub(crate) async fn bind_phone_of(
    state: &AppState,
    user_id: UserId,
    body: &BindPhoneRequest,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<RegisteredUser, ApiError> {
    let phone = parse_phone(&body.phone)?;
    verify_code(state, &phone, &body.code).await?;
    state
        .users
        .bind_phone(user_id, phone, metadata)
        .await
        .map_err(register_error)
}

/// Give an account made with a phone code a username and a password, to log in with them too
/// (from a program, or without the phone at hand). A username, once set, stays.
#[utoipa::path(
    put, path = "/api/v1/me/username", tag = "users", security(("bearer" = [])),
    request_body(content = crate::http::auth::RegisterRequest, description = "the same rules as registering"),
    responses(
        (status = 200, body = UserView),
        (status = 401, body = crate::http::problem::Problem),
        (status = 409, description = "`username-taken`, or `username-already-set`: this account has another username", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule (named)", body = crate::http::problem::Problem),
    )
)]
pub async fn set_username(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<crate::http::auth::RegisterRequest>,
) -> Result<HttpResponse, ApiError> {
    let metadata = event_metadata(&request, caller.actor());
    let user = username_of(&state, caller.user_id(), &body, &metadata).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// Set `user_id`'s username and password (the API and the settings page). Both fields are
/// checked before the name is claimed.
pub(crate) async fn username_of(
    state: &AppState,
    user_id: UserId,
    body: &crate::http::auth::RegisterRequest,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<RegisteredUser, ApiError> {
    let username = crate::http::auth::parse_username(&body.username);
    let password = parse_password("password", &body.password);
    let (username, password) = match (username, password) {
        (Ok(username), Ok(password)) => (username, password),
        (
            Err(ApiError::Validation { field, broken }),
            Err(ApiError::Validation {
                field: other,
                broken: other_broken,
            }),
        ) => {
            return Err(ApiError::InvalidFields(vec![
                (field, broken),
                (other, other_broken),
            ]));
        }
        (Err(error), _) | (_, Err(error)) => return Err(error),
    };
    let user = state
        .users
        .set_username(user_id, username, &password, &state.passwords, metadata)
        .await
        .map_err(|error| match error {
            RegisterError::Rejected(error @ UserError::UsernameAlreadySet { .. }) => {
                ApiError::Conflict {
                    rule: "username-already-set",
                    detail: error.to_string(),
                }
            }
            error => register_error(error),
        })?;
    // The gallery named them by a short id until now.
    state.gallery.forget_name(user_id).await;
    Ok(user)
}

/// Choose the name others see. Works, likes and your page show it on every instance at once.
#[utoipa::path(
    put, path = "/api/v1/me/display-name", tag = "users", security(("bearer" = [])),
    request_body = DisplayNameRequest,
    responses(
        (status = 200, body = UserView),
        (status = 401, body = crate::http::problem::Problem),
        (status = 422, description = "`display_name` breaks its rule (named)", body = crate::http::problem::Problem),
        (status = 429, description = "`renamed-too-often`: 5 changes in 24 hours, the most; `Retry-After` says when", body = crate::http::problem::Problem),
    )
)]
pub async fn set_display_name(
    state: web::Data<AppState>,
    request: HttpRequest,
    caller: Authenticated,
    body: crate::http::extract::Json<DisplayNameRequest>,
) -> Result<HttpResponse, ApiError> {
    let metadata = event_metadata(&request, caller.actor());
    let user = display_name_of(&state, caller.user_id(), &body.display_name, &metadata).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// Set (or, empty, take away) `user_id`'s display name, and drop every copy that shows the old
/// one (the API and the settings page).
pub(crate) async fn display_name_of(
    state: &AppState,
    user_id: UserId,
    raw: &str,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<RegisteredUser, ApiError> {
    let name = if zhihui_domain::text::is_blank(raw) {
        None
    } else {
        Some(
            DisplayName::parse(raw)
                .map_err(|invalid| ApiError::invalid("display_name", invalid.0))?,
        )
    };
    let command = UserCommand::SetDisplayName {
        name,
        at: state.clock.now(),
    };
    let user = match state.users.update(user_id, command, metadata).await {
        Ok(user) => user,
        Err(RegisterError::Rejected(error @ UserError::RenamedTooOften { again_at })) => {
            return Err(ApiError::TooManyRequests {
                rule: "renamed-too-often",
                detail: error.to_string(),
                retry_at: again_at,
                retry_after_s: crate::http::retry_after(&state.clock, again_at),
            });
        }
        Err(error) => return Err(register_error(error)),
    };
    state.gallery.forget_name(user_id).await;
    Ok(user)
}

/// Any user's profile (admins).
#[utoipa::path(
    get, path = "/api/v1/admin/users/{id}", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "user id")),
    responses(
        (status = 200, body = UserView),
        (status = 403, description = "`admin-only`", body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
    )
)]
pub async fn admin_user(
    state: web::Data<AppState>,
    _admin: Admin,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let user = existing_user(&state, parse_user_id(&path)?).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// Change a user's role (admins). The user's sessions end; the new role holds from the next login.
#[utoipa::path(
    put, path = "/api/v1/admin/users/{id}/role", tag = "admin", security(("bearer" = [])),
    params(("id" = Uuid, Path, description = "user id")),
    request_body = ChangeRoleRequest,
    responses(
        (status = 200, body = UserView),
        (status = 403, description = "`admin-only`", body = crate::http::problem::Problem),
        (status = 404, body = crate::http::problem::Problem),
        (status = 409, description = "`own-role`: an admin's own role", body = crate::http::problem::Problem),
    )
)]
pub async fn change_role(
    state: web::Data<AppState>,
    request: HttpRequest,
    admin: Admin,
    path: web::Path<String>,
    body: crate::http::extract::Json<ChangeRoleRequest>,
) -> Result<HttpResponse, ApiError> {
    let user_id = parse_user_id(&path)?;
    let metadata = event_metadata(&request, admin.actor());
    let user = change_role_of(&state, &admin, user_id, body.role, &metadata).await?;
    Ok(HttpResponse::Ok().json(UserView::from(&user)))
}

/// Give `user_id` another role; their sessions end (the API and the admin pages). An admin
/// never changes their own: the last admin could otherwise leave the platform with none, and
/// another admin is there to do it when it is meant.
pub(crate) async fn change_role_of(
    state: &AppState,
    admin: &Admin,
    user_id: UserId,
    role: Role,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<zhihui_domain::user::RegisteredUser, ApiError> {
    if admin.0.user_id == user_id {
        return Err(ApiError::Conflict {
            rule: "own-role",
            detail: "an admin cannot change their own role; another admin can".into(),
        });
    }
    let before = existing_user(state, user_id).await?;
    let command = UserCommand::ChangeRole {
        role,
        at: state.clock.now(),
    };
    let (state, metadata) = (state.clone(), metadata.clone());
    // To its end even if the request is dropped (past its deadline, its client gone): the
    // sessions and cached keys follow the role only here, and the same request sent again finds
    // the role changed already.
    crate::platform::worker_local::off_worker(Box::pin(async move {
        let user = state
            .users
            .update(user_id, command, &metadata)
            .await
            .map_err(register_error)?;
        if before.role != user.role {
            state.end_sessions(user_id).await?;
            // An admin's key loses the admin scope with the role, on every instance.
            state.api_keys.forget_user(&user).await?;
        }
        Ok(user)
    }))
    .await
}
