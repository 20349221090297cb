//! Admission limits that do not depend on who the caller claims to be: logins per client (an
//! IP address), login-code requests per client and per minute overall. Checked before any
//! password is hashed or code sent, so a flood from one client, or a spray of codes to many
//! phones, is refused at the cost of one Redis call. Sliding windows on the application clock
//! (`lua/rate_sliding.lua`): at most `max` in any `window`, never twice that across a boundary
//! of the calendar.

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

    /// Count one request of `scope` (e.g. `login:client:<ip>`): admitted when fewer than `max`
    /// were admitted in the `window` that ends now.
    pub async fn admit(
        &self,
        scope: &str,
        max: u32,
        window: Duration,
    ) -> anyhow::Result<Admission> {
        let window_ms = millis(window).max(1) as i64;
        let mut connection = self.redis.connection().await?;
        let free_at: i64 = crate::identity::scripts::RATE_SLIDING
            .key(self.redis.key(&format!("limit:{scope}")))
            .arg(max)
            .arg(window_ms)
            .arg(self.clock.now_ms())
            .invoke_async(&mut connection)
            .await
            .with_context(|| format!("counting {scope}"))?;
        Ok(if free_at > 0 {
            Admission::Full {
                retry_at: from_unix_ms(free_at),
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
