//! `/api/v1/auth/*`: register, log in (password or phone code), ask for a code, log out.

use std::time::Duration;
use zhihui_domain::rule::{Broken, Rule};

use actix_web::{HttpRequest, HttpResponse, web};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::claim::Identifier;
use zhihui_domain::user::{
    PhoneNumber, RegisteredUser, Role, UserCommand, UserError, UserId, Username,
};

use crate::http::extract::Authenticated;
use crate::http::{ApiError, event_metadata, retry_after};
use crate::identity::GuardState;
use crate::identity::password::PlainPassword;
use crate::identity::phone_codes::{SendOutcome, VerifyOutcome};
use crate::identity::users::RegisterError;
use crate::state::AppState;

/// A user as the API shows it. Never carries the password hash.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct UserView {
    pub id: Uuid,
    pub username: Option<String>,
    /// The name others see, when one was chosen (`PUT /api/v1/me/display-name`).
    pub display_name: Option<String>,
    pub phone: Option<String>,
    #[schema(value_type = String, example = "user")]
    pub role: Role,
    pub registered_at: DateTime<Utc>,
}

impl From<&RegisteredUser> for UserView {
    fn from(user: &RegisteredUser) -> UserView {
        UserView {
            id: user.user_id.as_uuid(),
            username: user.username.as_ref().map(|name| name.to_string()),
            display_name: user.display_name.as_ref().map(ToString::to_string),
            phone: user.phone.as_ref().map(|phone| phone.to_string()),
            role: user.role,
            registered_at: user.registered_at,
        }
    }
}

pub(crate) fn register_error(error: RegisterError) -> ApiError {
    match error {
        RegisterError::Taken { what } => ApiError::Conflict {
            rule: if what == "username" {
                "username-taken"
            } else {
                "phone-taken"
            },
            detail: format!("this {what} is already taken"),
        },
        RegisterError::Rejected(UserError::NotRegistered) => {
            ApiError::NotFound("no such user".into())
        }
        RegisterError::Rejected(error @ UserError::PhoneAlreadyBound { .. }) => {
            ApiError::Conflict {
                rule: "phone-already-bound",
                detail: error.to_string(),
            }
        }
        RegisterError::Rejected(error) => ApiError::Conflict {
            rule: "user-rule",
            detail: error.to_string(),
        },
        // A store away or the password checks busy: 503 or 429, not our bug.
        RegisterError::Unexpected(error) => ApiError::from(error),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    /// 3 to 32 letters, digits, `_`, `-`, `.`; starts with a letter; case-insensitive.
    #[schema(
        min_length = 3,
        max_length = 32,
        pattern = "^[A-Za-z][A-Za-z0-9_.-]{2,31}$"
    )]
    pub username: String,
    /// 8 to 128 characters, not only spaces.
    #[schema(min_length = 8, max_length = 128, pattern = "\\S")]
    pub password: String,
}

/// A forgotten password set again, proven by a code sent to the account's phone.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PasswordResetRequest {
    /// The phone bound to the account: E.164 (`+8613800138000`), or an 11-digit mainland
    /// mobile number.
    pub phone: String,
    /// A code sent to that phone by `POST /api/v1/auth/code`.
    pub code: String,
    /// 8 to 128 characters, not only spaces.
    #[schema(min_length = 8, max_length = 128, pattern = "\\S")]
    pub new_password: String,
}

/// Either `username` + `password`, or `phone` + `code` (from `POST /api/v1/auth/code`).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoginRequest {
    pub username: Option<String>,
    pub password: Option<String>,
    /// E.164 (`+8613800138000`), or an 11-digit mainland mobile number.
    pub phone: Option<String>,
    pub code: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LoginResponse {
    /// Send as `Authorization: Bearer <token>`. Shown once; zhihui keeps only its digest.
    pub token: String,
    pub token_type: &'static str,
    /// The token dies this long after its last use; every use renews it.
    pub idle_timeout_s: u64,
    pub expires_at: DateTime<Utc>,
    pub user: UserView,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CodeRequest {
    pub phone: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct CodeSent {
    /// The code is valid until then.
    pub expires_at: DateTime<Utc>,
    /// No new code for this phone before then.
    pub next_send_at: DateTime<Utc>,
}

pub(crate) fn parse_username(raw: &str) -> Result<Username, ApiError> {
    Username::parse(raw).map_err(|error| ApiError::invalid("username", error.0))
}

pub(crate) fn parse_phone(raw: &str) -> Result<PhoneNumber, ApiError> {
    PhoneNumber::parse(raw).map_err(|error| ApiError::invalid("phone", error.0))
}

pub(crate) fn parse_password(field: &str, raw: &str) -> Result<PlainPassword, ApiError> {
    PlainPassword::parse(raw).map_err(|broken| ApiError::invalid(field, broken))
}

/// Register with a username and a password. Answers the new user; log in to get a token.
#[utoipa::path(
    post, path = "/api/v1/auth/register", tag = "auth",
    request_body = RegisterRequest,
    responses(
        (status = 201, description = "registered", body = UserView),
        (status = 403, description = "registration is switched off (`registration-closed`)", body = crate::http::problem::Problem),
        (status = 409, description = "the username is taken (`username-taken`)", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule (`validation`, names the field)", body = crate::http::problem::Problem),
    )
)]
pub async fn register(
    state: web::Data<AppState>,
    request: HttpRequest,
    body: crate::http::extract::Json<RegisterRequest>,
) -> Result<HttpResponse, ApiError> {
    let user = register_user(&state, &request, &body).await?;
    Ok(HttpResponse::Created().json(user))
}

/// Register with a username and a password (the API and the pages).
pub(crate) async fn register_user(
    state: &AppState,
    request: &HttpRequest,
    body: &RegisterRequest,
) -> Result<UserView, ApiError> {
    if !state.auth_settings.registration_enabled {
        return Err(ApiError::Forbidden {
            rule: "registration-closed",
            detail: "registration is switched off on this server; ask an admin for an account"
                .into(),
        });
    }
    let username = parse_username(&body.username)?;
    let password = parse_password("password", &body.password)?;
    let metadata = event_metadata(request, "anonymous:registration".into());
    let user = state
        .users
        .register_with_password(username, &password, &state.passwords, Role::User, &metadata)
        .await
        .map_err(register_error)?;
    Ok(UserView::from(&user))
}

/// Log in with `username` + `password`, or with `phone` + `code`. A first code login of a phone
/// creates its user.
#[utoipa::path(
    post, path = "/api/v1/auth/login", tag = "auth",
    request_body = LoginRequest,
    responses(
        (status = 200, description = "a fresh bearer token", body = LoginResponse),
        (status = 401, description = "`wrong-credentials`, `wrong-code` or `code-expired`", body = crate::http::problem::Problem),
        (status = 409, description = "`credentials-changed`: the password or role changed during this login (log in again)", body = crate::http::problem::Problem),
        (status = 422, description = "a field breaks its rule", body = crate::http::problem::Problem),
        (status = 429, description = "`username-locked` (wrong passwords from this address, or from this browser, or for a browser never logged in from after many from every address) or `phone-locked` until `retry_at`; `too-many-logins` from this client in the last minute (`Retry-After`)", body = crate::http::problem::Problem),
    )
)]
pub async fn login(
    state: web::Data<AppState>,
    request: HttpRequest,
    body: crate::http::extract::Json<LoginRequest>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(log_in(&state, &request, body.into_inner()).await?))
}

/// Log in: every limit and lock of the API's route, for the API and the pages alike.
pub(crate) async fn log_in(
    state: &AppState,
    request: &HttpRequest,
    body: LoginRequest,
) -> Result<LoginResponse, ApiError> {
    let client = client_scope(state, request);
    admit_login(state, &client).await?;
    // Before the credentials are read: a password or role change from here on refuses this
    // login's session.
    let since = state.sessions.login_epoch().await?;
    let user = match (body.username, body.password, body.phone, body.code) {
        (Some(username), Some(password), None, None) => {
            let device = request
                .cookie(crate::http::cookie::LOGIN_DEVICE_COOKIE)
                .map(|cookie| cookie.value().to_owned());
            password_login(state, &username, &password, device.as_deref(), client).await?
        }
        (None, None, Some(phone), Some(code)) => {
            let metadata = event_metadata(request, "anonymous:phone-login".into());
            code_login(state, &phone, &code, &metadata).await?
        }
        (Some(_), None, None, None) => return Err(missing("password", "username")),
        (None, Some(_), None, None) => return Err(missing("username", "password")),
        (None, None, Some(_), None) => return Err(missing("code", "phone")),
        (None, None, None, Some(_)) => return Err(missing("phone", "code")),
        (None, None, None, None) => {
            return Err(ApiError::invalid_by("username", Rule::LoginEither));
        }
        _ => {
            return Err(ApiError::invalid_by("phone", Rule::LoginNotBoth));
        }
    };
    let Some((token, expires_at)) = state
        .sessions
        .create(user.user_id, user.role, since)
        .await?
    else {
        return Err(ApiError::Conflict {
            rule: "credentials-changed",
            detail: "the password or role of this user changed while logging in; log in again"
                .into(),
        });
    };
    Ok(LoginResponse {
        token,
        token_type: "Bearer",
        idle_timeout_s: state.sessions.idle_ttl().as_secs(),
        expires_at,
        user: UserView::from(&user),
    })
}

/// A login (or a password reset, which ends in one) from `client`, within its per-minute limit.
async fn admit_login(state: &AppState, client: &str) -> Result<(), ApiError> {
    admit(
        state,
        &format!("login:{client}"),
        state.auth_settings.logins_per_client_per_minute,
        Duration::from_secs(60),
        "too-many-logins",
        "this client has tried to log in too often in the last minute",
    )
    .await
}

fn missing(field: &str, with: &str) -> ApiError {
    ApiError::invalid(field, Broken::new(Rule::RequiredWith).with("with", with))
}

fn wrong_credentials() -> ApiError {
    ApiError::Unauthorized {
        rule: "wrong-credentials",
        detail: "wrong username or password".into(),
    }
}

fn locked(state: &AppState, rule: &'static str, what: &str, until: DateTime<Utc>) -> ApiError {
    ApiError::TooManyRequests {
        rule,
        detail: format!("{what} is locked after too many wrong attempts, until {until}"),
        retry_at: until,
        retry_after_s: retry_after(&state.clock, until),
    }
}

async fn password_login(
    state: &AppState,
    username: &str,
    password: &str,
    device: Option<&str>,
    client: String,
) -> Result<RegisteredUser, ApiError> {
    // A name that cannot exist cannot log in; answering like any wrong password keeps the
    // username rules from becoming an oracle.
    let Ok(username) = Username::parse(username) else {
        return Err(wrong_credentials());
    };
    let source = state
        .password_guard
        .source_of(&username, device, client)
        .await?;
    if let GuardState::Locked { until } = state.password_guard.check(&username, &source).await? {
        return Err(locked(state, "username-locked", "this username", until));
    }
    let user = state
        .users
        .find(&Identifier::Username(username.clone()))
        .await?;
    let hash = user.as_ref().and_then(|user| user.password_hash.as_ref());
    if state.passwords.verify(password, hash).await? {
        state.password_guard.reset(&username, &source).await?;
        // `verify` is false without a hash, and a hash only exists on a found user.
        return user.ok_or_else(wrong_credentials);
    }
    match state
        .password_guard
        .record_failure(&username, &source)
        .await?
    {
        GuardState::Locked { until } => {
            Err(locked(state, "username-locked", "this username", until))
        }
        GuardState::Open => Err(wrong_credentials()),
    }
}

async fn code_login(
    state: &AppState,
    phone: &str,
    code: &str,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<RegisteredUser, ApiError> {
    let phone = parse_phone(phone)?;
    verify_code(state, &phone, code).await?;
    state
        .users
        .find_or_register_by_phone(&phone, metadata)
        .await
        .map_err(register_error)
}

/// Set a forgotten password again: a code sent to the phone bound to the account proves who
/// asks. Every session of the account ends (its API keys keep working), and the lock that
/// wrong passwords put on its username is lifted for where the request comes from.
#[utoipa::path(
    post, path = "/api/v1/auth/password-reset", tag = "auth",
    request_body = PasswordResetRequest,
    responses(
        (status = 204, description = "the password is set: log in with it"),
        (status = 401, description = "`wrong-code` or `code-expired`", body = crate::http::problem::Problem),
        (status = 404, description = "`phone-not-bound`: no account has this phone", body = crate::http::problem::Problem),
        (status = 409, description = "`no-password-account`: the account logs in with codes only and has no username", body = crate::http::problem::Problem),
        (status = 422, description = "the phone or the new password breaks its rule (the code is not used up)", body = crate::http::problem::Problem),
        (status = 429, description = "`phone-locked` after wrong codes; `too-many-logins` from this client", body = crate::http::problem::Problem),
    )
)]
pub async fn reset_password(
    state: web::Data<AppState>,
    request: HttpRequest,
    body: crate::http::extract::Json<PasswordResetRequest>,
) -> Result<HttpResponse, ApiError> {
    reset_password_of(&state, &request, &body).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// [`reset_password`], for the API and the pages alike.
pub(crate) async fn reset_password_of(
    state: &AppState,
    request: &HttpRequest,
    body: &PasswordResetRequest,
) -> Result<(), ApiError> {
    // Every rule before the code is used up: a password typed too short costs no code.
    let phone = parse_phone(&body.phone)?;
    let new_password = parse_password("new_password", &body.new_password)?;
    let client = client_scope(state, request);
    admit_login(state, &client).await?;
    verify_code(state, &phone, &body.code).await?;
    let Some(user) = state.users.find(&Identifier::Phone(phone)).await? else {
        return Err(ApiError::Refused {
            status: actix_web::http::StatusCode::NOT_FOUND,
            rule: "phone-not-bound",
            detail: "no account has this phone bound; logging in with a code makes one".into(),
            window: None,
        });
    };
    let Some(username) = user.username.clone() else {
        return Err(ApiError::Conflict {
            rule: "no-password-account",
            detail: "this account logs in with codes sent to its phone and has no password".into(),
        });
    };
    let metadata = event_metadata(request, format!("user:{}", user.user_id));
    set_password(state, user.user_id, &new_password, &metadata).await?;
    let device = request
        .cookie(crate::http::cookie::LOGIN_DEVICE_COOKIE)
        .map(|cookie| cookie.value().to_owned());
    let source = state
        .password_guard
        .source_of(&username, device.as_deref(), client)
        .await?;
    state.password_guard.reset(&username, &source).await?;
    Ok(())
}

/// Record `new_password` as `user_id`'s and end every session of theirs (a change proven by
/// the current password, or a reset by a code sent to their phone).
pub(crate) async fn set_password(
    state: &AppState,
    user_id: UserId,
    new_password: &PlainPassword,
    metadata: &crate::platform::event_store::EventMetadata,
) -> Result<(), ApiError> {
    let password_hash = state.passwords.hash(new_password).await?;
    let command = UserCommand::ChangePassword {
        password_hash,
        at: state.clock.now(),
    };
    let (state, metadata) = (state.clone(), metadata.clone());
    // To its end even if the request is dropped (past its deadline, its client gone): the
    // sessions end only here, and the same request sent again is refused the old password.
    crate::platform::worker_local::off_worker(Box::pin(async move {
        state
            .users
            .update(user_id, command, &metadata)
            .await
            .map_err(register_error)?;
        state.end_sessions(user_id).await?;
        Ok(())
    }))
    .await
}

/// Use up the code of `phone`, or answer why not (wrong, expired, locked).
pub(crate) async fn verify_code(
    state: &AppState,
    phone: &PhoneNumber,
    code: &str,
) -> Result<(), ApiError> {
    match state.phone_codes.verify(phone, code).await? {
        VerifyOutcome::Accepted => Ok(()),
        VerifyOutcome::Wrong { attempts_left } => Err(ApiError::Unauthorized {
            rule: "wrong-code",
            detail: format!("wrong code; {attempts_left} more wrong code(s) lock this phone"),
        }),
        VerifyOutcome::Expired => Err(ApiError::Unauthorized {
            rule: "code-expired",
            detail: "no valid code for this phone: it expired, was used, or was never sent; ask \
                     for a new one"
                .into(),
        }),
        VerifyOutcome::Locked { until } => Err(locked(state, "phone-locked", "this phone", until)),
    }
}

/// Send a one-time login code to a phone.
#[utoipa::path(
    post, path = "/api/v1/auth/code", tag = "auth",
    request_body = CodeRequest,
    responses(
        (status = 202, description = "a code is on its way", body = CodeSent),
        (status = 422, description = "the phone number breaks its rule", body = crate::http::problem::Problem),
        (status = 429, description = "`too-many-sends` (one per interval), `daily-send-limit`, or `phone-locked`, until `retry_at`; `too-many-code-requests` from this client in the last hour, `code-requests-busy` (the overall ceiling in the last minute), with `Retry-After`", body = crate::http::problem::Problem),
        (status = 503, description = "`phone-login-disabled`: this server sends no codes (`auth.code_sender`)", body = crate::http::problem::Problem),
    )
)]
pub async fn send_code(
    state: web::Data<AppState>,
    request: HttpRequest,
    body: crate::http::extract::Json<CodeRequest>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Accepted().json(send_login_code(&state, &request, &body.phone).await?))
}

/// Send a login code to `phone`, within every limit (the API and the pages).
pub(crate) async fn send_login_code(
    state: &AppState,
    request: &HttpRequest,
    phone: &str,
) -> Result<CodeSent, ApiError> {
    let phone = parse_phone(phone)?;
    if state.auth_settings.code_sender == crate::platform::configuration::CodeSenderKind::Disabled {
        return Err(ApiError::Refused {
            status: actix_web::http::StatusCode::SERVICE_UNAVAILABLE,
            rule: "phone-login-disabled",
            detail: "this server sends no login codes (auth.code_sender is disabled); log in with a password".into(),
            window: None,
        });
    }
    let client = client_scope(state, request);
    admit(
        state,
        &format!("code:{client}"),
        state.auth_settings.code_requests_per_client_per_hour,
        Duration::from_secs(3600),
        "too-many-code-requests",
        "this client has asked for too many login codes in the last hour",
    )
    .await?;
    admit(
        state,
        "code:all",
        state.auth_settings.code_requests_per_minute_max,
        Duration::from_secs(60),
        "code-requests-busy",
        "the server has sent the most login codes it may in a minute",
    )
    .await?;
    match state.phone_codes.send(&phone).await? {
        SendOutcome::Sent {
            expires_at,
            next_send_at,
        } => Ok(CodeSent {
            expires_at,
            next_send_at,
        }),
        SendOutcome::TooSoon { retry_at } => Err(ApiError::TooManyRequests {
            rule: "too-many-sends",
            detail: format!(
                "a code was sent to this phone moments ago; the next one at {retry_at}"
            ),
            retry_at,
            retry_after_s: retry_after(&state.clock, retry_at),
        }),
        SendOutcome::DailyLimit { retry_at } => Err(ApiError::TooManyRequests {
            rule: "daily-send-limit",
            detail: format!(
                "this phone has had the most codes a day allows ({}); the next one at {retry_at}",
                state.auth_settings.code_sends_per_day_max
            ),
            retry_at,
            retry_after_s: retry_after(&state.clock, retry_at),
        }),
        SendOutcome::Locked { until } => Err(locked(state, "phone-locked", "this phone", until)),
    }
}

/// Revoke the token of this request.
#[utoipa::path(
    post, path = "/api/v1/auth/logout", tag = "auth",
    security(("bearer" = [])),
    responses(
        (status = 204, description = "the token is revoked"),
        (status = 401, description = "`missing-token` or `invalid-token`", body = crate::http::problem::Problem),
    )
)]
pub async fn logout(
    state: web::Data<AppState>,
    caller: Authenticated,
) -> Result<HttpResponse, ApiError> {
    state.end_session(&caller.0).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// The limit scope of a request's client: its address (see `http.client_ip_from_forwarded`).
fn client_scope(state: &AppState, request: &HttpRequest) -> String {
    crate::identity::admission::client_ip(request, state.http_settings.client_ip_from_forwarded)
        .map_or_else(|| "client:unknown".to_owned(), |ip| format!("client:{ip}"))
}

/// Count one request against a limit; 429 naming `rule` with `Retry-After` when it is full.
async fn admit(
    state: &AppState,
    scope: &str,
    max: u32,
    window: Duration,
    rule: &'static str,
    detail: &str,
) -> Result<(), ApiError> {
    match state.limits.admit(scope, max, window).await? {
        crate::identity::admission::Admission::Admitted => Ok(()),
        crate::identity::admission::Admission::Full { retry_at } => {
            Err(ApiError::TooManyRequests {
                rule,
                detail: format!("{detail} (at most {max}); again at {retry_at}"),
                retry_at,
                retry_after_s: retry_after(&state.clock, retry_at),
            })
        }
    }
}
