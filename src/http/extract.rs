//! Authorization as extractors: a handler that takes [`Authenticated`] only runs for a valid
//! bearer token (else 401), one that takes [`Admin`] only for an admin's token (else 403). Using a
//! token renews it (sliding expiry).
//!
//! Ownership is the handler's job and always answers 404 for another user's resource
//! ([`ensure_owner`]): a 403 would confirm that the resource exists.

use actix_web::dev::Payload;
use actix_web::{FromRequest, HttpRequest, web};
use futures::future::LocalBoxFuture;
use zhihui_domain::user::{Role, UserId};

use crate::http::ApiError;
use crate::identity::sessions::Session;
use crate::state::AppState;
use zhihui_domain::api_key::Scope;

/// A caller with a valid token.
#[derive(Debug, Clone)]
pub struct Authenticated(pub Session);

/// A caller with a valid token and the admin role.
#[derive(Debug, Clone)]
pub struct Admin(pub Session);

impl Authenticated {
    pub fn user_id(&self) -> UserId {
        self.0.user_id
    }

    /// The `actor` recorded on events this caller causes (with the API key, when it came with
    /// one: the audit shows which key moved which points).
    pub fn actor(&self) -> String {
        actor_of(&self.0)
    }
}

impl Admin {
    pub fn actor(&self) -> String {
        actor_of(&self.0)
    }
}

/// `admin:<id>` or `user:<id>`, and `/key:<key id>` when an API key made the request.
pub fn actor_of(session: &Session) -> String {
    let person = match session.role {
        Role::Admin => format!("admin:{}", session.user_id),
        Role::User => format!("user:{}", session.user_id),
    };
    match &session.key {
        Some(key) => format!("{person}/key:{}", key.key_id),
        None => person,
    }
}

pub fn bearer_token(request: &HttpRequest) -> Result<String, ApiError> {
    let header = request
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .ok_or_else(|| ApiError::Unauthorized {
            rule: "missing-token",
            detail: "this endpoint needs an `Authorization: Bearer <token>` header; get a token \
                     from POST /api/v1/auth/login"
                .into(),
        })?;
    let value = header.to_str().unwrap_or("");
    match value.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(token.trim().to_owned())
        }
        _ => Err(ApiError::Unauthorized {
            rule: "missing-token",
            detail: "the Authorization header must be `Bearer <token>`".into(),
        }),
    }
}

pub(crate) async fn authenticate(request: HttpRequest) -> Result<Session, ApiError> {
    let state = request
        .app_data::<web::Data<AppState>>()
        .ok_or_else(|| anyhow::anyhow!("AppState is not registered"))?
        .clone();
    // A browser signed in to the web app holds the same token in its session cookie: images,
    // the CSV export and the socket ticket are the API's own routes. A cookie is only taken
    // for a state-changing request with its CSRF token (a page on another site can make the
    // browser send the cookie, never the token).
    if request
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .is_none()
        && let Some(cookie) = request.cookie(crate::http::cookie::SESSION_COOKIE)
    {
        let token = cookie.value().to_owned();
        let safe = matches!(
            *request.method(),
            actix_web::http::Method::GET | actix_web::http::Method::HEAD
        );
        let csrf_ok = request
            .headers()
            .get(crate::http::cookie::CSRF_HEADER)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|presented| crate::http::cookie::csrf_matches(&token, presented));
        if !safe && !csrf_ok {
            return Err(ApiError::Forbidden {
                rule: "csrf-token-missing",
                detail: "a request signed in by the session cookie must carry its X-CSRF-Token"
                    .into(),
            });
        }
        return session_of(&state, &token).await;
    }
    let token = bearer_token(&request)?;
    if token.starts_with(zhihui_domain::api_key::KEY_PREFIX) {
        return key_session(&state, &request, &token).await;
    }
    session_of(&state, &token).await
}

/// The scope an API key needs for a route (by method and route template); `None`: the route
/// takes a person's session only (their password, phone, keys, sessions, sockets).
pub fn scope_for(method: &actix_web::http::Method, pattern: &str) -> Option<Scope> {
    use actix_web::http::Method;
    let read = *method == Method::GET || *method == Method::HEAD;
    // Who is an admin is decided by people: a program holding the admin scope may grant
    // points or run servers, but never makes (or unmakes) an admin, nor makes keys: a key
    // never makes keys, not even through the admin's routes for another user's.
    if pattern == "/api/v1/admin/users/{id}/role"
        || pattern.starts_with("/api/v1/admin/users/{id}/keys")
    {
        return None;
    }
    if pattern.starts_with("/api/v1/admin/") {
        return Some(Scope::Admin);
    }
    match (pattern, read) {
        ("/api/v1/tasks", false)
        | ("/api/v1/tasks/{id}/prioritise", false)
        | ("/api/v1/tasks/{id}/cancel", false) => Some(Scope::TasksWrite),
        ("/api/v1/tasks", true) | ("/api/v1/tasks/{id}", true) | ("/api/v1/images/{id}", true) => {
            Some(Scope::TasksRead)
        }
        ("/api/v1/me", true)
        | ("/api/v1/users/{id}", true)
        | ("/api/v1/account", true)
        | ("/api/v1/account/ledger", true)
        | ("/api/v1/checkins", true)
        | ("/api/v1/promotions", true)
        | ("/api/v1/promotions/{id}/claims/me", true) => Some(Scope::AccountRead),
        ("/api/v1/codes/redeem", false) => Some(Scope::CodesRedeem),
        ("/api/v1/gallery/feed", true)
        | ("/api/v1/gallery/likes", true)
        | ("/api/v1/me/works", true)
        | ("/api/v1/gallery/works", false)
        | ("/api/v1/gallery/works/{id}/unpublish", false)
        | ("/api/v1/gallery/works/{id}/like", false)
        | ("/api/v1/gallery/works/{id}/report", false)
        | ("/api/v1/gallery/creators/{id}/follow", false)
        | ("/api/v1/gallery/creators/{id}/block", false) => Some(Scope::GalleryWrite),
        (pattern, _) if pattern.starts_with("/api/v1/me/webhooks") => Some(Scope::Webhooks),
        _ => None,
    }
}

/// What anyone may read without logging in (the public gallery): a key of any scope reads it,
/// as its owner with `gallery:write` (their likes, follows and blocks shown), else as a visitor.
pub fn is_public_read(method: &actix_web::http::Method, pattern: &str) -> bool {
    use actix_web::http::Method;
    (*method == Method::GET || *method == Method::HEAD)
        && matches!(
            pattern,
            "/api/v1/gallery/hot"
                | "/api/v1/gallery/new"
                | "/api/v1/gallery/works/{id}"
                | "/api/v1/gallery/works/{id}/images/{image}"
                | "/api/v1/gallery/creators/{id}"
                | "/api/v1/gallery/creators/{id}/works"
        )
}

/// A caller with an API key: known, within its scopes, within its rate.
async fn key_session(
    state: &AppState,
    request: &HttpRequest,
    token: &str,
) -> Result<Session, ApiError> {
    let grant = state
        .api_keys
        .authenticate(token)
        .await
        .map_err(|refusal| match refusal {
            crate::identity::api_keys::KeyRefusal::Unexpected(error) => ApiError::from(error),
            refusal => ApiError::Unauthorized {
                rule: "invalid-key",
                detail: refusal.to_string(),
            },
        })?;
    let pattern = request.match_pattern().unwrap_or_default();
    if !is_public_read(request.method(), &pattern) {
        let Some(needed) = scope_for(request.method(), &pattern) else {
            return Err(ApiError::Forbidden {
                rule: "scope-missing",
                detail: format!(
                    "{} {pattern} takes a person's session, not an API key",
                    request.method()
                ),
            });
        };
        if !grant.allows(needed) {
            return Err(ApiError::Forbidden {
                rule: "scope-missing",
                detail: format!("this key lacks the scope {needed}"),
            });
        }
    }
    match state
        .limits
        .admit(
            &format!("key:{}", grant.key_id),
            grant.requests_per_minute,
            std::time::Duration::from_secs(60),
        )
        .await?
    {
        crate::identity::admission::Admission::Admitted => {}
        crate::identity::admission::Admission::Full { retry_at } => {
            return Err(ApiError::TooManyRequests {
                rule: "key-rate-limited",
                detail: format!(
                    "this key made its {} requests of the last minute; again at {retry_at}",
                    grant.requests_per_minute
                ),
                retry_at,
                retry_after_s: crate::http::retry_after(&state.clock, retry_at),
            });
        }
    }
    state.api_keys.note_use(grant.key_id).await;
    state.active_users.seen(grant.user_id.as_uuid()).await;
    Ok(Session {
        user_id: grant.user_id,
        role: grant.role,
        expires_at: grant
            .expires_at
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC),
        token_digest: format!("key:{}", grant.key_id),
        key: Some(grant),
    })
}

/// The session of a token from elsewhere than the header (a browser's WebSocket cannot set one).
pub async fn session_of(state: &AppState, token: &str) -> Result<Session, ApiError> {
    let session = state
        .sessions
        .touch(token)
        .await?
        .ok_or_else(|| ApiError::Unauthorized {
            rule: "invalid-token",
            detail: "the token is unknown, expired or revoked; log in again".into(),
        })?;
    // Daily active users: at most one Redis call per user per day in this process.
    state.active_users.seen(session.user_id.as_uuid()).await;
    Ok(session)
}

impl FromRequest for Authenticated {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, _payload: &mut Payload) -> Self::Future {
        let request = request.clone();
        Box::pin(async move { authenticate(request).await.map(Authenticated) })
    }
}

impl FromRequest for Admin {
    type Error = ApiError;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, _payload: &mut Payload) -> Self::Future {
        let request = request.clone();
        Box::pin(async move {
            let session = authenticate(request).await?;
            if session.role != Role::Admin {
                return Err(admin_only());
            }
            Ok(Admin(session))
        })
    }
}

/// 404 unless the caller owns the resource (see the module comment).
pub fn ensure_owner(caller: &Authenticated, owner: UserId, what: &str) -> Result<(), ApiError> {
    if caller.user_id() == owner {
        Ok(())
    } else {
        Err(ApiError::NotFound(format!("no such {what}")))
    }
}

/// Whole JSON numbers as JSON Schema's `integer` counts them: `3` and `3.0` alike (a client
/// that computes a count in floating point sends `3.0`); `3.5` or a value out of the type's range
/// is refused, and the body's error names the field. For `#[serde(deserialize_with)]`.
pub mod whole {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer};
    use zhihui_domain::rule::{Broken, Rule};

    /// The number as a `T`, or why not.
    pub fn of_number<T: TryFrom<i64> + TryFrom<u64>>(
        number: &serde_json::Number,
    ) -> Result<T, Broken> {
        let out_of_range = || Broken::new(Rule::OutOfRange).with("value", number);
        if let Some(value) = number.as_u64() {
            return T::try_from(value).map_err(|_| out_of_range());
        }
        if let Some(value) = number.as_i64() {
            return T::try_from(value).map_err(|_| out_of_range());
        }
        match number.as_f64() {
            // Within ±2^53 every whole f64 converts exactly.
            Some(value) if value.fract() == 0.0 && value.abs() < 9_007_199_254_740_992.0 => {
                T::try_from(value as i64).map_err(|_| out_of_range())
            }
            _ => Err(Broken::new(Rule::WholeNumber).with("value", number)),
        }
    }

    fn of<T: TryFrom<i64> + TryFrom<u64>, E: Error>(number: serde_json::Number) -> Result<T, E> {
        of_number(&number).map_err(E::custom)
    }

    pub fn u32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
        of(serde_json::Number::deserialize(deserializer)?)
    }

    /// [`u32`] for a field that may be absent or null.
    pub fn optional_u32<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<u32>, D::Error> {
        Option::<serde_json::Number>::deserialize(deserializer)?
            .map(of)
            .transpose()
    }
}

/// Amounts of points, as a JSON number or a string of plain digits: `"12"`, `"12.5"`, `"0.5"`.
/// A string is what the API document states (a pattern), so a string the pattern refuses is
/// refused here too (`"1e3"`, `"+5"`, `".5"`, `"00005"`, `" 5"`) rather than read by the decimal
/// parser's looser rules; the amount's own rules (positive, places, ceiling) come after, in the
/// domain. For `#[serde(deserialize_with)]`.
pub mod decimal {
    use rust_decimal::Decimal;
    use serde::de::Error;
    use serde::{Deserialize, Deserializer};
    use zhihui_domain::rule::{Broken, Rule};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Text(String),
        Number(serde_json::Number),
    }

    /// Digits with no sign, no exponent, no leading zero (but `0.x`), and a fraction of digits.
    fn plain(text: &str) -> bool {
        let (whole, fraction) = match text.split_once('.') {
            Some((whole, fraction)) => (whole, Some(fraction)),
            None => (text, None),
        };
        let digits = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
        digits(whole) && (whole == "0" || !whole.starts_with('0')) && fraction.is_none_or(digits)
    }

    pub fn plain_decimal<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Decimal, D::Error> {
        let text = match Written::deserialize(deserializer)? {
            Written::Text(text) => {
                if !plain(&text) {
                    return Err(D::Error::custom(
                        Broken::new(Rule::PlainDecimal).with("value", format!("{text:?}")),
                    ));
                }
                text
            }
            Written::Number(number) => number.to_string(),
        };
        text.parse::<Decimal>()
            .or_else(|_| Decimal::from_scientific(&text))
            .map_err(|_| {
                D::Error::custom(Broken::new(Rule::PlainDecimal).with("value", text.clone()))
            })
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn only_plain_digits_are_an_amount_written_as_text() {
            for good in ["5", "12.5", "0.5", "0.05", "100000", "5.00", "10"] {
                assert!(super::plain(good), "{good}");
            }
            for bad in [
                "1e3", "+5", "-5", ".5", "5.", "00005", "05", " 5", "5 ", "", "0x10", "五",
            ] {
                assert!(!super::plain(bad), "{bad}");
            }
        }
    }
}

/// A JSON request body that must be an object, read as `T`. serde reads a struct from an array
/// too (its fields by position): `["a title", true]` would be a publish. The body is checked as
/// JSON first (actix's `Json` with the app's `JsonConfig`: its limit, content type and errors),
/// then its first character, then read as `T`; a field's value that cannot be read is a 422
/// naming that field.
#[derive(Debug)]
pub struct Json<T>(pub T);

impl<T> Json<T> {
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> std::ops::Deref for Json<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: serde::de::DeserializeOwned + 'static> FromRequest for Json<T> {
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let raw = web::Json::<Box<serde_json::value::RawValue>>::from_request(request, payload);
        let request = request.clone();
        Box::pin(async move {
            match Self::read(raw.await) {
                Ok(json) => Ok(json),
                // Who may call comes before what they sent: a stranger learns nothing of a
                // route's body rules (a 401 or 403, not a 422), whichever extractor finished first.
                Err(error) => match caller_refused(&request).await {
                    Some(refused) => Err(refused.into()),
                    None => Err(error),
                },
            }
        })
    }
}

/// Why the caller may not use this route, when they may not: every JSON route but signing up and
/// in needs a signed-in caller, and those under `/api/v1/admin/` an admin.
async fn caller_refused(request: &HttpRequest) -> Option<ApiError> {
    let pattern = request.match_pattern().unwrap_or_default();
    if pattern.starts_with("/api/v1/auth/") {
        return None;
    }
    match authenticate(request.clone()).await {
        Err(error) => Some(error),
        Ok(session) if pattern.starts_with("/api/v1/admin/") && session.role != Role::Admin => {
            Some(admin_only())
        }
        Ok(_) => None,
    }
}

fn admin_only() -> ApiError {
    ApiError::Forbidden {
        rule: "admin-only",
        detail: "this endpoint is for admins".into(),
    }
}

impl<T: serde::de::DeserializeOwned> Json<T> {
    /// The body read as `T`, or the 422 naming what could not be read. Not async: the body is
    /// all there once actix's `Json` has answered.
    fn read(
        raw: Result<web::Json<Box<serde_json::value::RawValue>>, actix_web::Error>,
    ) -> Result<Self, actix_web::Error> {
        let raw = raw?.into_inner();
        let unreadable = |field: String, detail: String| -> actix_web::Error {
            ApiError::invalid(
                field,
                zhihui_domain::rule::Broken::new(zhihui_domain::rule::Rule::Unreadable)
                    .with("detail", detail),
            )
            .into()
        };
        if !raw.get().starts_with('{') {
            return Err(unreadable(
                "body".into(),
                "the body must be a JSON object".into(),
            ));
        }
        // A value a field cannot take names the field (its path: `amount`, `event_types[1]`),
        // and so does a field missing, unknown or given twice; anything else is the body's.
        let mut deserializer = serde_json::Deserializer::from_str(raw.get());
        serde_path_to_error::deserialize(&mut deserializer)
            .map(Json)
            .map_err(|error| {
                let path = error.path().to_string();
                let detail = error.into_inner().to_string();
                unreadable(field_named(&path, &detail, "body"), detail)
            })
    }
}

/// The field a deserializing error is about: its path, or, at the top, the field serde's message
/// names (`missing field `amount``, `unknown field `nte``, `duplicate field `limit``), else
/// `whole` (the body, the query).
fn field_named(path: &str, detail: &str, whole: &str) -> String {
    if path != "." {
        return path.to_owned();
    }
    ["missing field `", "unknown field `", "duplicate field `"]
        .iter()
        .find_map(|prefix| detail.strip_prefix(prefix))
        .and_then(|rest| rest.split_once('`'))
        .map_or_else(|| whole.to_owned(), |(name, _)| name.to_owned())
}

/// A query string read as `T`, a 422 naming the parameter that could not be read (`limit`, not
/// "the query"), after the caller's own refusal as for [`Json`].
#[derive(Debug)]
pub struct Query<T>(pub T);

impl<T> Query<T> {
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> std::ops::Deref for Query<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: serde::de::DeserializeOwned + 'static> FromRequest for Query<T> {
    type Error = actix_web::Error;
    type Future = LocalBoxFuture<'static, Result<Self, Self::Error>>;

    fn from_request(request: &HttpRequest, _payload: &mut Payload) -> Self::Future {
        let read = {
            let query = request.query_string();
            let deserializer =
                serde_urlencoded::Deserializer::new(url::form_urlencoded::parse(query.as_bytes()));
            serde_path_to_error::deserialize(deserializer).map_err(|error| {
                let path = error.path().to_string();
                let detail = error.into_inner().to_string();
                ApiError::invalid(
                    field_named(&path, &detail, "query"),
                    zhihui_domain::rule::Broken::new(zhihui_domain::rule::Rule::Unreadable)
                        .with("detail", detail),
                )
            })
        };
        let request = request.clone();
        Box::pin(async move {
            let pattern = request.match_pattern().unwrap_or_default();
            // The public gallery answers anyone, and the socket is opened with a ticket: a
            // query they cannot read is theirs to be told about.
            let open_to_all = is_public_read(request.method(), &pattern) || pattern == "/api/v1/ws";
            match read {
                Ok(value) => Ok(Query(value)),
                Err(error) if open_to_all => Err(error.into()),
                Err(error) => match caller_refused(&request).await {
                    Some(refused) => Err(refused.into()),
                    None => Err(error.into()),
                },
            }
        })
    }
}
