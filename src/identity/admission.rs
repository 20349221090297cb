//! Admission limits that do not depend on who the caller claims to be: logins per client (an
//! IP address), login-code requests per client and per minute overall. Checked before any
//! password is hashed or code sent, so a flood from one client, or a spray of codes to many
//! phones, is refused at the cost of one Redis call. Fixed windows on the application clock
//! (`lua/rate_window.lua`).

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};

use crate::platform::clock::{Clock, from_unix_ms, millis};
use crate::platform::redis_store::RedisStore;

/// What a limit answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admitted,
    /// The window is full until then.
    Full {
        retry_at: DateTime<Utc>,
    },
}

#[derive(Debug, Clone)]
pub struct Limits {
    redis: RedisStore,
    clock: Clock,
}

impl Limits {
    pub fn new(redis: RedisStore, clock: Clock) -> Limits {
        Limits { redis, clock }
    }

    /// Count one request of `scope` (e.g. `login:client:<ip>`) in its current `window`, at most
    /// `max` per window.
    pub async fn admit(
        &self,
        scope: &str,
        max: u32,
        window: Duration,
    ) -> anyhow::Result<Admission> {
        let window_ms = millis(window).max(1) as i64;
        let start = self.clock.now_ms().div_euclid(window_ms) * window_ms;
        let mut connection = self.redis.connection().await?;
        let count: i64 = crate::identity::scripts::RATE_WINDOW
            .key(self.redis.key(&format!("limit:{scope}:{start}")))
            .arg(max)
            .arg(window_ms * 2)
            .invoke_async(&mut connection)
            .await
            .with_context(|| format!("counting {scope}"))?;
        Ok(if count < 0 {
            Admission::Full {
                retry_at: from_unix_ms(start + window_ms),
            }
        } else {
            Admission::Admitted
        })
    }
}

/// The client of a request: the connection's peer, or the first address of `X-Forwarded-For`
/// when `http.client_ip_from_forwarded` says a trusted proxy sets it (otherwise anyone could
/// name any address and escape the per-client limits).
pub fn client_ip(request: &actix_web::HttpRequest, from_forwarded: bool) -> Option<IpAddr> {
    if from_forwarded
        && let Some(first) = request
            .headers()
            .get("x-forwarded-for")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.split(',').next())
        && let Ok(ip) = first.trim().parse::<IpAddr>()
    {
        return Some(ip);
    }
    request.peer_addr().map(|address| address.ip())
}
