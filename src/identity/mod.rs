//! Authentication: passwords (argon2id), bearer-token sessions with a sliding expiry, one-time
//! phone codes, and the brute-force limits on both login paths. Authorization (who may call which
//! endpoint) is the HTTP extractors' job, in `crate::http::extract`.

pub mod active_users;
pub mod admission;
pub mod api_keys;
pub mod password;
pub mod phone_codes;
pub mod scripts;
pub mod sessions;
pub mod users;

use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use zhihui_domain::user::Username;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha256};

use crate::platform::clock::Clock;
use crate::platform::redis_store::RedisStore;

/// How long Redis keeps a username's failure counter after its last failure.
pub const LOGIN_FAILURES_KEEP_MS: u64 = 24 * 60 * 60 * 1000;

/// How long a browser a user logged in from stays known to the guard (its device cookie).
pub const LOGIN_DEVICE_TTL: Duration = Duration::from_secs(180 * 24 * 60 * 60);

/// Password guessing limits that stop a guesser without locking the owner out.
///
/// A lock per username alone lets anyone lock a known user out by guessing ten times. Here the
/// wrong passwords are counted per source: a client address (`failures_max` locks that address
/// out of that username for `lockout`) or, when the attempt comes from a browser that logged
/// in as that user before, that browser's device cookie (its own count, the same limit). Many
/// addresses guessing together are stopped by a count over every address
/// (`all_sources_max`), which a known browser does not answer to: the owner at their own
/// browser still gets in while a guesser spread over many addresses is stopped. Unknown names
/// are counted too, so the answers never tell which exist.
#[derive(Debug, Clone)]
pub struct PasswordGuard {
    redis: RedisStore,
    clock: Clock,
    failures_max: u32,
    all_sources_max: u32,
    lockout: Duration,
}

/// Where a password attempt comes from, as the guard counts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoginSource {
    /// A browser that logged in as this username before: its device cookie's digest.
    KnownDevice(String),
    /// Anything else: the client's address (`client:<ip>`).
    Client(String),
}

impl LoginSource {
    fn scope(&self) -> String {
        match self {
            LoginSource::KnownDevice(digest) => format!("device:{digest}"),
            LoginSource::Client(client) => client.clone(),
        }
    }
}

/// Whether a password may be tried now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardState {
    Open,
    Locked { until: DateTime<Utc> },
}

impl PasswordGuard {
    pub fn new(
        redis: RedisStore,
        clock: Clock,
        failures_max: u32,
        all_sources_max: u32,
        lockout: Duration,
    ) -> Self {
        PasswordGuard {
            redis,
            clock,
            failures_max,
            all_sources_max,
            lockout,
        }
    }

    async fn call(
        &self,
        username: &Username,
        scope: &str,
        failures_max: u32,
        operation: &str,
    ) -> anyhow::Result<GuardState> {
        let mut connection = self.redis.connection().await?;
        let (status, value): (String, i64) = crate::identity::scripts::LOGIN_FAILURES
            .key(
                self.redis
                    .key(&format!("login-failures:{username}:{scope}")),
            )
            .arg(operation)
            .arg(self.clock.now_ms())
            .arg(failures_max)
            .arg(crate::platform::clock::millis(self.lockout))
            .arg(LOGIN_FAILURES_KEEP_MS)
            .invoke_async(&mut connection)
            .await
            .context("updating the password failure counter")?;
        Ok(match status.as_str() {
            "locked" => GuardState::Locked {
                until: crate::platform::clock::from_unix_ms(value),
            },
            _ => GuardState::Open,
        })
    }

    /// The counts `source` answers to: its own, and for an unknown source the one over all.
    fn scopes(&self, source: &LoginSource) -> Vec<(String, u32)> {
        let mut scopes = vec![(source.scope(), self.failures_max)];
        if let LoginSource::Client(_) = source {
            scopes.push(("all".to_owned(), self.all_sources_max));
        }
        scopes
    }

    /// Whether `source` may try a password for `username` now.
    pub async fn check(
        &self,
        username: &Username,
        source: &LoginSource,
    ) -> anyhow::Result<GuardState> {
        for (scope, max) in self.scopes(source) {
            let state = self.call(username, &scope, max, "check").await?;
            if state != GuardState::Open {
                return Ok(state);
            }
        }
        Ok(GuardState::Open)
    }

    /// Count a wrong password; the answer says whether that locked `source` out.
    pub async fn record_failure(
        &self,
        username: &Username,
        source: &LoginSource,
    ) -> anyhow::Result<GuardState> {
        let mut answer = GuardState::Open;
        for (scope, max) in self.scopes(source) {
            let state = self.call(username, &scope, max, "fail").await?;
            if answer == GuardState::Open {
                answer = state;
            }
        }
        Ok(answer)
    }

    /// The right password: `source`'s count and the one over all start again (only someone
    /// holding the password gets here).
    pub async fn reset(&self, username: &Username, source: &LoginSource) -> anyhow::Result<()> {
        self.call(username, &source.scope(), self.failures_max, "reset")
            .await?;
        self.call(username, "all", self.all_sources_max, "reset")
            .await?;
        Ok(())
    }

    /// Remember a browser `username` logged in from: a new device token for its cookie (only
    /// its digest is kept, for [`LOGIN_DEVICE_TTL`]).
    pub async fn remember_device(&self, username: &Username) -> anyhow::Result<String> {
        let mut bytes = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut bytes);
        let token = URL_SAFE_NO_PAD.encode(bytes);
        let mut connection = self.redis.connection().await?;
        let _: () = redis::AsyncCommands::pset_ex(
            &mut connection,
            self.redis
                .key(&format!("login-device:{}", device_digest(&token))),
            username.to_string(),
            crate::platform::clock::millis(LOGIN_DEVICE_TTL),
        )
        .await
        .context("remembering a login device")?;
        Ok(token)
    }

    /// Where an attempt for `username` comes from: the browser's device cookie when it logged
    /// in as `username` before, else the client's address.
    pub async fn source_of(
        &self,
        username: &Username,
        device_token: Option<&str>,
        client: String,
    ) -> anyhow::Result<LoginSource> {
        let Some(token) = device_token.filter(|token| token.len() <= 64) else {
            return Ok(LoginSource::Client(client));
        };
        let digest = device_digest(token);
        let mut connection = self.redis.connection().await?;
        let owner: Option<String> = redis::AsyncCommands::get(
            &mut connection,
            self.redis.key(&format!("login-device:{digest}")),
        )
        .await
        .context("reading a login device")?;
        Ok(if owner == Some(username.to_string()) {
            LoginSource::KnownDevice(digest)
        } else {
            LoginSource::Client(client)
        })
    }
}

/// SHA-256 of a device token, base64url: the only form in which Redis sees one.
fn device_digest(token: &str) -> String {
    URL_SAFE_NO_PAD.encode(Sha256::digest(token.as_bytes()))
}
