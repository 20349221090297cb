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

use crate::platform::clock::Clock;
use crate::platform::redis_store::RedisStore;

/// How long Redis keeps a username's failure counter after its last failure.
pub const LOGIN_FAILURES_KEEP_MS: u64 = 24 * 60 * 60 * 1000;

/// Password guessing limit per username: after `failures_max` wrong passwords in a row the name
/// is locked for `lockout`. Unknown names are counted too, so the answer never tells which exist.
#[derive(Debug, Clone)]
pub struct PasswordGuard {
    redis: RedisStore,
    clock: Clock,
    failures_max: u32,
    lockout: Duration,
}

/// Whether a password may be tried now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuardState {
    Open,
    Locked { until: DateTime<Utc> },
}

impl PasswordGuard {
    pub fn new(redis: RedisStore, clock: Clock, failures_max: u32, lockout: Duration) -> Self {
        PasswordGuard {
            redis,
            clock,
            failures_max,
            lockout,
        }
    }

    async fn call(&self, username: &Username, operation: &str) -> anyhow::Result<GuardState> {
        let mut connection = self.redis.connection().await?;
        let (status, value): (String, i64) = crate::identity::scripts::LOGIN_FAILURES
            .key(self.redis.key(&format!("login-failures:{username}")))
            .arg(operation)
            .arg(self.clock.now_ms())
            .arg(self.failures_max)
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

    pub async fn check(&self, username: &Username) -> anyhow::Result<GuardState> {
        self.call(username, "check").await
    }

    /// Count a wrong password; the answer says whether that locked the name.
    pub async fn record_failure(&self, username: &Username) -> anyhow::Result<GuardState> {
        self.call(username, "fail").await
    }

    pub async fn reset(&self, username: &Username) -> anyhow::Result<()> {
        self.call(username, "reset").await.map(|_| ())
    }
}
