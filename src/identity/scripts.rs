//! The identity room's Redis scripts: sessions (create, touch with sliding expiry, revoke one or
//! all of a user's), phone codes (send limits, verify with lockout), the password guard's
//! failure count and the admission limits (sliding windows).

use crate::platform::lua::redis_script;

redis_script!(SESSION_CREATE, "session_create.lua");
redis_script!(SESSION_TOUCH, "session_touch.lua");
redis_script!(SESSION_REVOKE, "session_revoke.lua");
redis_script!(SESSIONS_REVOKE_USER, "sessions_revoke_user.lua");
redis_script!(PHONE_CODE_SEND, "phone_code_send.lua");
redis_script!(PHONE_CODE_VERIFY, "phone_code_verify.lua");
redis_script!(LOGIN_FAILURES, "login_failures.lua");
redis_script!(RATE_SLIDING, "rate_sliding.lua");
