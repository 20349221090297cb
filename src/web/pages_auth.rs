//! Signing up, in (password or phone code) and out, and choosing the language. Plain forms
//! (they work without scripts): a refusal shows the form again with the reason in the reader's
//! words; a sign-in sets the session cookie and goes where the reader was going.

use actix_web::cookie::Cookie;
use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use minijinja::context;
use serde::Deserialize;

use super::i18n::{LANG_COOKIE, Lang};
use super::render::{Page, WebError, encode_path, safe_next};
use super::session;
use crate::http::ApiError;
use crate::http::auth::{LoginRequest, RegisterRequest};

#[derive(Debug, Deserialize)]
pub struct NextQuery {
    next: Option<String>,
    /// Sent here after a password change (every session ended): the page says why.
    changed: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct LoginForm {
    method: String,
    username: Option<String>,
    password: Option<String>,
    phone: Option<String>,
    code: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct PhoneForm {
    phone: String,
}

#[derive(Debug, Deserialize)]
pub struct ResetForm {
    phone: String,
    #[serde(default)]
    code: String,
    #[serde(default)]
    new_password: String,
}

#[derive(Debug, Deserialize)]
pub struct RegisterForm {
    username: String,
    password: String,
}

/// The login page (a signed-in reader goes on at once).
pub async fn login_page(
    page: Page,
    query: web::Query<NextQuery>,
) -> Result<HttpResponse, WebError> {
    let next = safe_next(query.next.as_deref());
    if page.member.is_some() {
        return Ok(Page::see_other(&next));
    }
    let extra = match query.changed {
        Some(_) => context! {
            message => page.t("settings.password_changed", &[]),
            message_kind => "info",
        },
        None => context! {},
    };
    login_form(&page, &next, extra, StatusCode::OK).await
}

async fn login_form(
    page: &Page,
    next: &str,
    extra: minijinja::Value,
    status: StatusCode,
) -> Result<HttpResponse, WebError> {
    let mut response = page
        .render(
            "login.html",
            context! { next_encoded => encode_path(next), ..extra },
        )
        .await?;
    *response.status_mut() = status;
    Ok(response)
}

/// Signed in: the session cookie, and on to where the reader was going.
fn signed_in(page: &Page, token: String, next: &str) -> HttpResponse {
    let secure = page.web().secure_cookies(&page.request);
    HttpResponse::SeeOther()
        .cookie(session::session_cookie(token, secure))
        .insert_header((actix_web::http::header::LOCATION, next))
        .finish()
}

fn status_of(error: &ApiError) -> StatusCode {
    actix_web::ResponseError::status_code(error)
}

/// A form shown again for `error`: its status, and when to try again where it says.
fn answer_for(mut response: HttpResponse, error: &ApiError) -> HttpResponse {
    *response.status_mut() = status_of(error);
    if let Some(seconds) = error.retry_after_s()
        && let Ok(value) = actix_web::http::header::HeaderValue::from_str(&seconds.to_string())
    {
        response
            .headers_mut()
            .insert(actix_web::http::header::RETRY_AFTER, value);
    }
    response
}

/// `POST /login`: a password or a phone code; the API's every limit and lock applies.
pub async fn login(
    page: Page,
    query: web::Query<NextQuery>,
    form: web::Form<LoginForm>,
) -> Result<HttpResponse, WebError> {
    let next = safe_next(query.next.as_deref());
    let form = form.into_inner();
    let request = match form.method.as_str() {
        "code" => LoginRequest {
            username: None,
            password: None,
            phone: form.phone.clone(),
            code: form.code,
        },
        _ => LoginRequest {
            username: form.username.clone(),
            password: form.password,
            phone: None,
            code: None,
        },
    };
    let password_login = request.password.is_some();
    match crate::http::auth::log_in(page.state(), &page.request, request).await {
        Ok(login) => {
            let mut response = signed_in(&page, login.token, &next);
            // This browser is now known for this username: its wrong passwords are counted
            // apart, so a guesser elsewhere cannot lock its owner out of it.
            if password_login
                && let Some(username) = form.username.as_deref()
                && let Ok(username) = zhihui_domain::identity::Username::parse(username)
            {
                let token = page
                    .state()
                    .password_guard
                    .remember_device(&username)
                    .await?;
                let cookie = Cookie::build(crate::http::cookie::LOGIN_DEVICE_COOKIE, token)
                    .path("/")
                    .http_only(true)
                    .same_site(actix_web::cookie::SameSite::Strict)
                    .secure(page.web().secure_cookies(&page.request))
                    .max_age(actix_web::cookie::time::Duration::seconds(
                        i64::try_from(crate::identity::LOGIN_DEVICE_TTL.as_secs())
                            .unwrap_or(i64::MAX),
                    ))
                    .finish();
                response.add_cookie(&cookie).map_err(anyhow::Error::from)?;
            }
            Ok(response)
        }
        Err(ApiError::Unexpected(error)) => Err(WebError::from(error)),
        Err(error) => {
            let message = page.message_of(&error);
            let form = login_form(
                &page,
                &next,
                context! { message, username => form.username, phone => form.phone },
                StatusCode::OK,
            )
            .await?;
            Ok(answer_for(form, &error))
        }
    }
}

/// `POST /login/code`: send a code to the phone, then show the form to type it in.
pub async fn send_code(
    page: Page,
    query: web::Query<NextQuery>,
    form: web::Form<PhoneForm>,
) -> Result<HttpResponse, WebError> {
    let next = safe_next(query.next.as_deref());
    let sent = crate::http::auth::send_login_code(page.state(), &page.request, &form.phone).await;
    let resend_in = resend_in(&page, &sent);
    match sent {
        Ok(_) => {
            let message = page.t("login.code_sent", &[]);
            login_form(
                &page,
                &next,
                context! { message, message_kind => "info", phone => form.phone.trim(), resend_in },
                StatusCode::OK,
            )
            .await
        }
        Err(ApiError::Unexpected(error)) => Err(WebError::from(error)),
        Err(error) => {
            let message = page.message_of(&error);
            let form = login_form(
                &page,
                &next,
                context! { message, phone => form.phone.trim(), resend_in },
                StatusCode::OK,
            )
            .await?;
            Ok(answer_for(form, &error))
        }
    }
}

/// `GET /password-reset`: a forgotten password set again with a code sent to the account's
/// phone (a signed-in reader goes to their settings: the forms here carry no CSRF token).
pub async fn reset_page(page: Page) -> Result<HttpResponse, WebError> {
    if page.member.is_some() {
        return Ok(Page::see_other("/settings"));
    }
    page.render("password_reset.html", context! {}).await
}

/// `POST /password-reset/code`: a code sent to the phone, then the form to type it in with
/// the new password.
pub async fn send_reset_code(
    page: Page,
    form: web::Form<PhoneForm>,
) -> Result<HttpResponse, WebError> {
    let sent = crate::http::auth::send_login_code(page.state(), &page.request, &form.phone).await;
    let resend_in = resend_in(&page, &sent);
    let phone = form.phone.trim();
    match sent {
        Ok(_) => {
            let message = page.t("login.code_sent", &[]);
            let context =
                context! { message, message_kind => "info", phone, resend_in, code_ready => true };
            page.render("password_reset.html", context).await
        }
        Err(ApiError::Unexpected(error)) => Err(WebError::from(error)),
        Err(error) => {
            let message = page.message_of(&error);
            // Too soon: a code sent a moment ago is still good.
            let context = context! { message, phone, resend_in, code_ready => resend_in.is_some() };
            let form = page.render("password_reset.html", context).await?;
            Ok(answer_for(form, &error))
        }
    }
}

/// `POST /password-reset`: set, on to the login page saying so; refused, why, with the phone
/// kept.
pub async fn reset_password(
    page: Page,
    form: web::Form<ResetForm>,
) -> Result<HttpResponse, WebError> {
    let form = form.into_inner();
    let request = crate::http::auth::PasswordResetRequest {
        phone: form.phone.clone(),
        code: form.code.clone(),
        new_password: form.new_password,
    };
    match crate::http::auth::reset_password_of(page.state(), &page.request, &request).await {
        Ok(()) => Ok(Page::see_other("/login?changed=1")),
        Err(ApiError::Unexpected(error)) => Err(WebError::from(error)),
        Err(error) => {
            let message = page.message_of(&error);
            // What was typed stays but the password: a code refused for another field's rule
            // is still good.
            let context = context! { message, phone => form.phone.trim(), code => form.code.trim(), code_ready => true };
            let form = page.render("password_reset.html", context).await?;
            Ok(answer_for(form, &error))
        }
    }
}

/// The longest wait a send-code button counts down on the page; a longer one (the day's sends
/// used up) is said in the message instead.
const RESEND_COUNTDOWN_MAX_S: u64 = 600;

/// Seconds until another code may be sent to the phone, for its button to count down: after a
/// code went, or a send refused as too soon; `None` when it may be sent now.
pub(super) fn resend_in(
    page: &Page,
    sent: &Result<crate::http::auth::CodeSent, ApiError>,
) -> Option<u64> {
    let seconds = match sent {
        Ok(sent) => crate::http::retry_after(&page.state().clock, sent.next_send_at),
        Err(ApiError::TooManyRequests { retry_after_s, .. }) => *retry_after_s,
        Err(_) => return None,
    };
    (seconds <= RESEND_COUNTDOWN_MAX_S).then_some(seconds)
}

pub async fn register_page(
    page: Page,
    query: web::Query<NextQuery>,
) -> Result<HttpResponse, WebError> {
    let next = safe_next(query.next.as_deref());
    if page.member.is_some() {
        return Ok(Page::see_other(&next));
    }
    page.render(
        "register.html",
        context! { next_encoded => encode_path(&next) },
    )
    .await
}

/// `POST /register`: register, then sign in with the same password (one step for the reader).
pub async fn register(
    page: Page,
    query: web::Query<NextQuery>,
    form: web::Form<RegisterForm>,
) -> Result<HttpResponse, WebError> {
    let next = safe_next(query.next.as_deref());
    let form = form.into_inner();
    let registered = crate::http::auth::register_user(
        page.state(),
        &page.request,
        &RegisterRequest {
            username: form.username.clone(),
            password: form.password.clone(),
        },
    )
    .await;
    let refused = |error: ApiError| async {
        if let ApiError::Unexpected(error) = error {
            return Err(WebError::from(error));
        }
        let message = page.message_of(&error);
        let response = page
            .render(
                "register.html",
                context! { message, username => form.username.clone(), next_encoded => encode_path(&next) },
            )
            .await?;
        Ok(answer_for(response, &error))
    };
    if let Err(error) = registered {
        return refused(error).await;
    }
    let login = LoginRequest {
        username: Some(form.username.clone()),
        password: Some(form.password.clone()),
        phone: None,
        code: None,
    };
    match crate::http::auth::log_in(page.state(), &page.request, login).await {
        Ok(login) => Ok(signed_in(&page, login.token, &next)),
        Err(error) => refused(error).await,
    }
}

/// `POST /logout`: the session ends everywhere (its sockets close), the cookie goes.
pub async fn logout(page: Page) -> Result<HttpResponse, WebError> {
    log_out(page, "/login").await
}

/// `POST /logout/password-reset`: a signed-in reader who forgot their password (the settings'
/// change needs it) leaves, on to the reset with a code to their phone.
pub async fn logout_to_reset(page: Page) -> Result<HttpResponse, WebError> {
    log_out(page, "/password-reset").await
}

/// End the reader's session and clear its cookie, on to `to`.
async fn log_out(page: Page, to: &str) -> Result<HttpResponse, WebError> {
    if let Some(member) = &page.member {
        page.state().end_session(&member.session).await?;
    }
    let secure = page.web().secure_cookies(&page.request);
    let mut response = if page.is_htmx() {
        HttpResponse::Ok()
            .insert_header(("HX-Redirect", to))
            .finish()
    } else {
        Page::see_other(to)
    };
    response
        .add_cookie(&session::cleared_session_cookie(secure))
        .map_err(|error| anyhow::anyhow!("setting a cookie: {error}"))?;
    Ok(response)
}

/// `GET /lang/{lang}?next=`: remember the language for a year and go back.
pub async fn choose_language(
    request: HttpRequest,
    path: web::Path<String>,
    query: web::Query<NextQuery>,
) -> HttpResponse {
    // A POST from our own pages only (a cross-site form or image cannot switch anyone's
    // language). The choice is a cookie of its own, not the session: no CSRF token is needed,
    // and the plain form works without script.
    let refused = if session::from_another_site(&request) {
        Some((StatusCode::FORBIDDEN, "error.another_site"))
    } else if Lang::parse(&path).is_none() {
        Some((StatusCode::NOT_FOUND, "error.not_found"))
    } else {
        None
    };
    let lang = match (refused, Lang::parse(&path)) {
        (None, Some(lang)) => lang,
        (refused, _) => {
            let (status, key) = refused.unwrap_or((StatusCode::NOT_FOUND, "error.not_found"));
            let body = super::render::failure_page(&request, status, key)
                .await
                .unwrap_or_default();
            return HttpResponse::build(status)
                .content_type("text/html; charset=utf-8")
                .body(body);
        }
    };
    let next = match query.next.as_deref() {
        Some(next) => {
            let decoded = safe_next(Some(next));
            // The login and registration pages are fine to go back to here.
            if next.starts_with("/login") || next.starts_with("%2Flogin") {
                "/login".to_owned()
            } else if next.starts_with("/register") || next.starts_with("%2Fregister") {
                "/register".to_owned()
            } else {
                decoded
            }
        }
        None => "/".to_owned(),
    };
    let cookie = Cookie::build(LANG_COOKIE, lang.code())
        .path("/")
        .same_site(actix_web::cookie::SameSite::Lax)
        .max_age(actix_web::cookie::time::Duration::days(365))
        .finish();
    HttpResponse::SeeOther()
        .cookie(cookie)
        .insert_header((actix_web::http::header::LOCATION, next))
        .finish()
}
