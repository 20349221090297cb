//! Bearer-token sessions in Redis with a sliding expiry.
//!
//! A token is the user's id (16 bytes) followed by 32 random bytes, base64url-encoded. The id part
//! only tells which user's session set to touch, in the same round trip; the random part is what
//! makes it unguessable, and Redis stores only the token's SHA-256 digest, so a copy of the Redis
//! data does not hand out sessions. A forged token naming someone else's id matches no digest. Each use slides the expiry to `now + idle ttl`; an
//! expired session is deleted on its next use. The expiry is checked against the application clock
//! (see `crate::platform::clock`); the Redis TTL set alongside is a longer safety net that reclaims memory.
//!
//! Each user's session keys are also kept in a set, so that a password or role change can revoke
//! all of them at once.

use std::time::Duration;

use anyhow::Context;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use rand::RngCore;
use sha2::{Digest, Sha256};
use uuid::Uuid;
use zhihui_domain::user::{Role, UserId};

use crate::platform::clock::{Clock, from_unix_ms, millis};
use crate::platform::redis_store::{RedisStore, user_tag};

/// Random bytes in a token: 256 bits, far beyond guessing.
pub const TOKEN_BYTES: usize = 32;
/// How much longer than the logical expiry Redis keeps a session key (clock skew between the
/// application and Redis, and a margin so the logical check always runs first).
pub const SESSION_SAFETY_SLACK_MS: u64 = 10 * 60 * 1000;

/// The credentials epoch a login began at ([`Sessions::login_epoch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoginEpoch(i64);

/// Who is calling, as a valid token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub user_id: UserId,
    pub role: Role,
    pub expires_at: DateTime<Utc>,
    /// Digest of the token, the handle to revoke exactly this session.
    pub token_digest: String,
    /// The API key this caller came with (`None`: a person's session).
    pub key: Option<crate::identity::api_keys::KeyGrant>,
}

#[derive(Debug, Clone)]
pub struct Sessions {
    redis: RedisStore,
    clock: Clock,
    idle_ttl: Duration,
}

impl Sessions {
    pub fn new(redis: RedisStore, clock: Clock, idle_ttl: Duration) -> Sessions {
        Sessions {
            redis,
            clock,
            idle_ttl,
        }
    }

    pub fn idle_ttl(&self) -> Duration {
        self.idle_ttl
    }

    /// A session, under its user's tag: the scripts touch it with the user's set of sessions
    /// (the token carries the user id, so the tag is known before Redis is asked).
    fn session_key(&self, user_id: UserId, token_digest: &str) -> String {
        self.redis
            .tagged(&user_tag(user_id), &format!("session:{token_digest}"))
    }

    fn user_sessions_key(&self, user_id: UserId) -> String {
        self.redis.tagged(&user_tag(user_id), "sessions")
    }

    fn idle_ttl_ms(&self) -> u64 {
        millis(self.idle_ttl)
    }

    fn epoch_key(&self) -> String {
        self.redis.key("credentials-epoch")
    }

    fn revoked_epoch_key(&self, user_id: UserId) -> String {
        self.redis.tagged(&user_tag(user_id), "revoked-epoch")
    }

    /// Read when a login begins, before the user's credentials are loaded: a password or role
    /// change that revokes the user's sessions after this point also refuses the login's
    /// session ([`Sessions::create`]), so no session checked against an old password survives
    /// the change. Ordered by Redis, not by clocks.
    pub async fn login_epoch(&self) -> anyhow::Result<LoginEpoch> {
        let mut connection = self.redis.connection().await?;
        let epoch: Option<i64> = redis::cmd("GET")
            .arg(self.epoch_key())
            .query_async(&mut connection)
            .await
            .context("reading the credentials epoch")?;
        Ok(LoginEpoch(epoch.unwrap_or(0)))
    }

    /// Open a session and return its token (shown to the client once, never stored); `None`
    /// when the user's sessions were revoked (a password or role change) after `since`.
    pub async fn create(
        &self,
        user_id: UserId,
        role: Role,
        since: LoginEpoch,
    ) -> anyhow::Result<Option<(String, DateTime<Utc>)>> {
        let mut bytes = [0u8; 16 + TOKEN_BYTES];
        bytes[..16].copy_from_slice(user_id.as_uuid().as_bytes());
        rand::rng().fill_bytes(&mut bytes[16..]);
        let token = URL_SAFE_NO_PAD.encode(bytes);
        let digest = token_digest(&token);
        let mut connection = self.redis.connection().await?;
        let expires_at_ms: i64 = crate::identity::scripts::SESSION_CREATE
            .key(self.session_key(user_id, &digest))
            .key(self.user_sessions_key(user_id))
            .key(self.revoked_epoch_key(user_id))
            .arg(user_id.to_string())
            .arg(role.as_str())
            .arg(self.clock.now_ms())
            .arg(self.idle_ttl_ms())
            .arg(self.idle_ttl_ms() + SESSION_SAFETY_SLACK_MS)
            .arg(since.0)
            .invoke_async(&mut connection)
            .await
            .context("creating a session in Redis")?;
        if expires_at_ms < 0 {
            return Ok(None);
        }
        Ok(Some((token, from_unix_ms(expires_at_ms))))
    }

    /// The session of `token` if it is valid now; using it slides its expiry.
    pub async fn touch(&self, token: &str) -> anyhow::Result<Option<Session>> {
        // A token we never issued cannot be valid; skip Redis for obvious garbage.
        let Some(user_id) = token_user_id(token) else {
            return Ok(None);
        };
        self.touch_digest(user_id, token_digest(token)).await
    }

    /// The session whose token has `digest`, if it is valid now (sliding its expiry).
    async fn touch_digest(
        &self,
        user_id: UserId,
        digest: String,
    ) -> anyhow::Result<Option<Session>> {
        let mut connection = self.redis.connection().await?;
        let touched: Option<(String, String, i64)> = crate::identity::scripts::SESSION_TOUCH
            .key(self.session_key(user_id, &digest))
            .key(self.user_sessions_key(user_id))
            .arg(self.clock.now_ms())
            .arg(self.idle_ttl_ms())
            .arg(self.idle_ttl_ms() + SESSION_SAFETY_SLACK_MS)
            .invoke_async(&mut connection)
            .await
            .context("touching a session")?;
        let Some((stored_user_id, role, expires_at_ms)) = touched else {
            return Ok(None);
        };
        if stored_user_id != user_id.to_string() {
            // Only a token forged from a real digest's owner could get here: treat as unknown.
            return Ok(None);
        }
        let role = match role.as_str() {
            "admin" => Role::Admin,
            "user" => Role::User,
            other => anyhow::bail!("session {digest} has an unknown role {other:?}"),
        };
        Ok(Some(Session {
            user_id,
            role,
            expires_at: from_unix_ms(expires_at_ms),
            token_digest: digest,
            key: None,
        }))
    }

    /// Whether `session` is still valid now, without sliding its expiry (an open socket checks
    /// this on every ping: a socket alone does not keep a session alive).
    pub async fn is_valid(&self, session: &Session) -> anyhow::Result<bool> {
        let mut connection = self.redis.connection().await?;
        let expires_at_ms: Option<i64> = redis::cmd("HGET")
            .arg(self.session_key(session.user_id, &session.token_digest))
            .arg("expires_at_ms")
            .query_async(&mut connection)
            .await
            .context("reading a session's expiry")?;
        Ok(expires_at_ms.is_some_and(|expires_at_ms| self.clock.now_ms() < expires_at_ms))
    }

    fn ticket_key(&self, ticket_digest: &str) -> String {
        self.redis.key(&format!("ws-ticket:{ticket_digest}"))
    }

    /// A one-time ticket to open one WebSocket as `session`, valid for `ttl`: a browser cannot
    /// set a header on a WebSocket, and a token in a URL ends up in logs and histories; a ticket
    /// there is worthless once used or after `ttl`. Redis keeps only its digest.
    pub async fn issue_ticket(
        &self,
        session: &Session,
        ttl: Duration,
    ) -> anyhow::Result<(String, DateTime<Utc>)> {
        let mut bytes = [0u8; TOKEN_BYTES];
        rand::rng().fill_bytes(&mut bytes);
        let ticket = URL_SAFE_NO_PAD.encode(bytes);
        let expires_at_ms = self.clock.now_ms() + millis(ttl) as i64;
        let value = format!(
            "{} {} {expires_at_ms}",
            session.user_id, session.token_digest
        );
        let mut connection = self.redis.connection().await?;
        redis::cmd("SET")
            .arg(self.ticket_key(&token_digest(&ticket)))
            .arg(value)
            .arg("PX")
            .arg(millis(ttl) + SESSION_SAFETY_SLACK_MS)
            .query_async::<()>(&mut connection)
            .await
            .context("storing a socket ticket")?;
        Ok((ticket, from_unix_ms(expires_at_ms)))
    }

    /// The session a ticket was issued for, once: the ticket is deleted in the same step it is
    /// read (GETDEL), so two sockets racing with one ticket get one session. Expired, used,
    /// unknown, or its session ended since: `None`.
    pub async fn redeem_ticket(&self, ticket: &str) -> anyhow::Result<Option<Session>> {
        if URL_SAFE_NO_PAD
            .decode(ticket)
            .map_or(true, |bytes| bytes.len() != TOKEN_BYTES)
        {
            return Ok(None);
        }
        let mut connection = self.redis.connection().await?;
        let value: Option<String> = redis::cmd("GETDEL")
            .arg(self.ticket_key(&token_digest(ticket)))
            .query_async(&mut connection)
            .await
            .context("redeeming a socket ticket")?;
        let Some(value) = value else {
            return Ok(None);
        };
        let mut parts = value.split(' ');
        let (Some(user_id), Some(digest), Some(expires_at_ms)) =
            (parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("a socket ticket is damaged");
        };
        let user_id =
            UserId::from_uuid(Uuid::parse_str(user_id).context("a socket ticket names no user")?);
        let expires_at_ms: i64 = expires_at_ms
            .parse()
            .context("a socket ticket has no expiry")?;
        if self.clock.now_ms() >= expires_at_ms {
            return Ok(None);
        }
        self.touch_digest(user_id, digest.to_owned()).await
    }

    /// Revoke one session (logout). True when it existed.
    pub async fn revoke(&self, session: &Session) -> anyhow::Result<bool> {
        let mut connection = self.redis.connection().await?;
        let removed: i64 = crate::identity::scripts::SESSION_REVOKE
            .key(self.session_key(session.user_id, &session.token_digest))
            .key(self.user_sessions_key(session.user_id))
            .invoke_async(&mut connection)
            .await
            .context("revoking a session")?;
        self.redis.revocation_replicated(&mut connection).await?;
        Ok(removed == 1)
    }

    /// Revoke every session of a user; returns how many there were.
    pub async fn revoke_all(&self, user_id: UserId) -> anyhow::Result<u64> {
        let mut connection = self.redis.connection().await?;
        // Two steps, each safe to repeat (the global epoch and the user's keys live in different
        // slots of a cluster): take a new epoch, then record it for the user (never lowering
        // it) and delete the sessions. A login that read an older epoch is refused from the
        // second step on; one that made its session in between has it deleted by that step.
        let epoch: i64 = redis::cmd("INCR")
            .arg(self.epoch_key())
            .query_async(&mut connection)
            .await
            .context("taking a credentials epoch")?;
        let revoked: u64 = crate::identity::scripts::SESSIONS_REVOKE_USER
            .key(self.user_sessions_key(user_id))
            .key(self.revoked_epoch_key(user_id))
            .arg(epoch)
            // Longer than any login can take (one ends with its request).
            .arg(millis(self.idle_ttl) + SESSION_SAFETY_SLACK_MS)
            .invoke_async(&mut connection)
            .await
            .context("revoking a user's sessions")?;
        self.redis.revocation_replicated(&mut connection).await?;
        Ok(revoked)
    }
}

/// The user id a well-formed token names (not yet verified: only Redis can say it is valid).
fn token_user_id(token: &str) -> Option<UserId> {
    let bytes = URL_SAFE_NO_PAD.decode(token).ok()?;
    if bytes.len() != 16 + TOKEN_BYTES {
        return None;
    }
    let id = Uuid::from_slice(&bytes[..16]).ok()?;
    Some(UserId::from_uuid(id))
}

/// SHA-256 of the token, base64url: the only form in which Redis sees a token.
fn token_digest(token: &str) -> String {
    URL_SAFE_NO_PAD.encode(Sha256::digest(token.as_bytes()))
}
