//! The browser session's cookie and its CSRF token, shared by the API's authentication
//! extractor (a signed-in browser calls the API's own routes with its cookie) and the web pages.
//!
//! The CSRF token is HMAC-SHA256 keyed by the session token over a fixed label: only a holder of
//! the cookie can compute it, it needs no server-side state, and showing it in a page reveals
//! nothing of the session token.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "zhihui_session";
/// The cookie of a browser a user logged in from (see `identity::PasswordGuard`): its wrong
/// passwords are counted apart from everyone else's, so a guesser cannot lock its owner out.
pub const LOGIN_DEVICE_COOKIE: &str = "zhihui_device";
/// The header a signed-in browser's state-changing requests carry.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// What the CSRF digest is computed over (versioned: a new scheme gets a new label).
const CSRF_LABEL: &[u8] = b"zhihui csrf v1";

/// The CSRF token of a session token.
pub fn csrf_token(session_token: &str) -> String {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(session_token.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(CSRF_LABEL);
    URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
}

/// Whether `presented` is the CSRF token of `session_token` (compared in constant time).
pub fn csrf_matches(session_token: &str, presented: &str) -> bool {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(session_token.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
    mac.update(CSRF_LABEL);
    match URL_SAFE_NO_PAD.decode(presented.trim()) {
        Ok(bytes) => mac.verify_slice(&bytes).is_ok(),
        Err(_) => false,
    }
}
