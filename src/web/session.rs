//! The browser's session: the API's own opaque token in an HttpOnly, SameSite=Strict cookie
//! (page scripts never see it), and the CSRF token derived from it.
//!
//! The CSRF token is HMAC-SHA256 keyed by the session token over a fixed label: only a holder of
//! the cookie can compute it, it needs no server-side state, and showing it in a page reveals
//! nothing of the session token. Every state-changing request of a signed-in browser sends it in
//! `X-CSRF-Token` (pages: htmx's `hx-headers`; the live module: its `fetch`).

use actix_web::HttpRequest;
use actix_web::cookie::{Cookie, SameSite};

pub use crate::http::cookie::{CSRF_HEADER, SESSION_COOKIE, csrf_matches, csrf_token};
use crate::identity::sessions::Session;
use crate::platform::configuration::CookieSecure;
use crate::state::AppState;

/// A signed-in browser: its session and the token it holds.
#[derive(Debug, Clone)]
pub struct Member {
    pub session: Session,
    pub token: String,
}

impl Member {
    pub fn csrf(&self) -> String {
        csrf_token(&self.token)
    }

    pub fn is_admin(&self) -> bool {
        self.session.role == zhihui_domain::user::Role::Admin
    }
}

/// The session of the request's cookie, if it holds a valid one (using it slides its expiry).
pub async fn member_of(state: &AppState, request: &HttpRequest) -> anyhow::Result<Option<Member>> {
    let Some(cookie) = request.cookie(SESSION_COOKIE) else {
        return Ok(None);
    };
    let token = cookie.value().to_owned();
    let Some(session) = state.sessions.touch(&token).await? else {
        return Ok(None);
    };
    state.active_users.seen(session.user_id.as_uuid()).await;
    Ok(Some(Member { session, token }))
}

/// Whether the request's CSRF header is the member's token.
pub fn csrf_presented(request: &HttpRequest, member: &Member) -> bool {
    request
        .headers()
        .get(CSRF_HEADER)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|presented| csrf_matches(&member.token, presented))
}

/// A state-changing request whose `Origin` names another site is refused: a form on another
/// site cannot sign anyone in or out, or act for them. (Browsers send `Origin` with every POST;
/// a request without one comes from no browser page.)
pub fn from_another_site(request: &HttpRequest) -> bool {
    let Some(origin) = request
        .headers()
        .get(actix_web::http::header::ORIGIN)
        .and_then(|value| value.to_str().ok())
    else {
        return false;
    };
    let host = request.connection_info().host().to_owned();
    let origin_host = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .unwrap_or("");
    origin_host != host
}

/// Whether cookies set on this request's answer are `Secure`: `auto` reads the scheme a proxy
/// reports (`Forwarded`, `X-Forwarded-Proto`) only when the configuration trusts the proxy
/// (`http.client_ip_from_forwarded`); otherwise this listener's own (plain HTTP).
pub fn secure(request: &HttpRequest, setting: CookieSecure, trust_forwarded: bool) -> bool {
    match setting {
        CookieSecure::Always => true,
        CookieSecure::Never => false,
        CookieSecure::Auto if trust_forwarded => request.connection_info().scheme() == "https",
        CookieSecure::Auto => request.app_config().secure(),
    }
}

/// The session cookie for `token`: a browser-session cookie (the server's sliding expiry rules).
pub fn session_cookie(token: String, secure: bool) -> Cookie<'static> {
    Cookie::build(SESSION_COOKIE, token)
        .path("/")
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(secure)
        .finish()
}

/// The cookie that removes the session cookie.
pub fn cleared_session_cookie(secure: bool) -> Cookie<'static> {
    let mut cookie = session_cookie(String::new(), secure);
    cookie.make_removal();
    cookie
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csrf_token_is_its_sessions_own() {
        let token = csrf_token("session-a");
        assert!(csrf_matches("session-a", &token));
        assert!(!csrf_matches("session-b", &token));
        assert!(!csrf_matches("session-a", ""));
        assert!(!csrf_matches("session-a", &token[1..]));
        assert!(!csrf_matches("session-a", "not base64 !"));
        assert_ne!(token, "session-a");
    }
}
