//! One-time login codes sent to phones, with every limit the platform promises: a code lives 2 minutes, one
//! send per 60 s and at most 10 per day per phone, and 5 wrong codes in a row lock the phone for
//! 10 minutes (all configurable in `[auth]`). Each check-and-change is one Lua script, so two
//! concurrent requests can never both pass a limit.
//!
//! Redis keeps only a digest of the code. The "day" of the daily limit is the calendar day at
//! `auth.day_utc_offset_minutes` (UTC+8 by default: the platform's users' day).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use rand::Rng;
use sha2::{Digest, Sha256};
use zhihui_domain::user::PhoneNumber;

use crate::platform::clock::{Clock, from_unix_ms, millis};
use crate::platform::configuration::AuthSettings;
use crate::platform::redis_store::RedisStore;

/// Digits in a code: one in a million per guess, and 5 guesses before a lock.
pub const CODE_DIGITS: u32 = 6;
/// How long Redis keeps a phone's counters after its last change: the daily count must outlive
/// its day, whatever the offset.
pub const PHONE_STATE_KEEP_MS: u64 = 2 * 24 * 60 * 60 * 1000;

const DAY_MS: i64 = 24 * 60 * 60 * 1000;

/// Delivers a code to a phone. Pluggable: the development sender writes it to the log; an SMS
/// gateway implements the same trait.
pub trait CodeSender: Send + Sync + std::fmt::Debug {
    fn send<'a>(
        &'a self,
        phone: &'a PhoneNumber,
        code: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<()>>;
}

/// The development sender: logs the code (never use it in production).
#[derive(Debug, Default)]
pub struct LogCodeSender;

impl CodeSender for LogCodeSender {
    fn send<'a>(
        &'a self,
        phone: &'a PhoneNumber,
        code: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async move {
            tracing::info!(%phone, code, "development code sender: login code");
            Ok(())
        })
    }
}

/// The outcome of asking for a code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    Sent {
        expires_at: DateTime<Utc>,
        next_send_at: DateTime<Utc>,
    },
    Locked {
        until: DateTime<Utc>,
    },
    TooSoon {
        retry_at: DateTime<Utc>,
    },
    DailyLimit {
        retry_at: DateTime<Utc>,
    },
}

/// The outcome of checking a code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyOutcome {
    Accepted,
    Wrong {
        attempts_left: u32,
    },
    /// No code was sent, it was used, or it is older than its lifetime.
    Expired,
    Locked {
        until: DateTime<Utc>,
    },
}

#[derive(Debug, Clone)]
pub struct PhoneCodes {
    redis: RedisStore,
    clock: Clock,
    sender: Arc<dyn CodeSender>,
    code_ttl: Duration,
    send_interval: Duration,
    sends_per_day_max: u32,
    failures_max: u32,
    lockout: Duration,
    day_utc_offset_ms: i64,
}

impl PhoneCodes {
    pub fn new(
        redis: RedisStore,
        clock: Clock,
        sender: Arc<dyn CodeSender>,
        settings: &AuthSettings,
    ) -> PhoneCodes {
        PhoneCodes {
            redis,
            clock,
            sender,
            code_ttl: Duration::from_millis(settings.code_ttl_ms),
            send_interval: Duration::from_millis(settings.code_send_interval_ms),
            sends_per_day_max: settings.code_sends_per_day_max,
            failures_max: settings.code_failures_max,
            lockout: Duration::from_millis(settings.code_lockout_ms),
            day_utc_offset_ms: i64::from(settings.day_utc_offset_minutes) * 60 * 1000,
        }
    }

    fn state_key(&self, phone: &PhoneNumber) -> String {
        self.redis.key(&format!("phone-code:{phone}"))
    }

    /// Generate a code, record it if the limits allow, then hand it to the sender.
    pub async fn send(&self, phone: &PhoneNumber) -> anyhow::Result<SendOutcome> {
        let code = format!(
            "{:0width$}",
            rand::rng().random_range(0..10u32.pow(CODE_DIGITS)),
            width = CODE_DIGITS as usize
        );
        let now_ms = self.clock.now_ms();
        let day = (now_ms + self.day_utc_offset_ms).div_euclid(DAY_MS);
        let mut connection = self.redis.connection().await?;
        let (status, at_ms): (String, i64) = crate::identity::scripts::PHONE_CODE_SEND
            .key(self.state_key(phone))
            .arg(now_ms)
            .arg(day)
            .arg(code_digest(phone, &code))
            .arg(millis(self.code_ttl))
            .arg(millis(self.send_interval))
            .arg(self.sends_per_day_max)
            .arg(PHONE_STATE_KEEP_MS)
            .invoke_async(&mut connection)
            .await
            .context("recording a login code")?;
        let outcome = match status.as_str() {
            "sent" => SendOutcome::Sent {
                expires_at: from_unix_ms(at_ms),
                next_send_at: from_unix_ms(now_ms) + self.send_interval,
            },
            "locked" => SendOutcome::Locked {
                until: from_unix_ms(at_ms),
            },
            "too_soon" => SendOutcome::TooSoon {
                retry_at: from_unix_ms(at_ms),
            },
            "daily_limit" => SendOutcome::DailyLimit {
                retry_at: from_unix_ms((day + 1) * DAY_MS - self.day_utc_offset_ms),
            },
            other => anyhow::bail!("phone_code_send.lua answered {other:?}"),
        };
        if matches!(outcome, SendOutcome::Sent { .. }) {
            self.sender
                .send(phone, &code)
                .await
                .with_context(|| format!("sending the login code to {phone}"))?;
        }
        Ok(outcome)
    }

    /// Check a submitted code; a right one is used up.
    pub async fn verify(&self, phone: &PhoneNumber, code: &str) -> anyhow::Result<VerifyOutcome> {
        let mut connection = self.redis.connection().await?;
        let (status, value): (String, i64) = crate::identity::scripts::PHONE_CODE_VERIFY
            .key(self.state_key(phone))
            .arg(self.clock.now_ms())
            .arg(code_digest(phone, code.trim()))
            .arg(self.failures_max)
            .arg(millis(self.lockout))
            .arg(PHONE_STATE_KEEP_MS)
            .invoke_async(&mut connection)
            .await
            .context("checking a login code")?;
        Ok(match status.as_str() {
            "ok" => VerifyOutcome::Accepted,
            "wrong" => VerifyOutcome::Wrong {
                attempts_left: u32::try_from(value).unwrap_or(0),
            },
            "expired" => VerifyOutcome::Expired,
            "locked" => VerifyOutcome::Locked {
                until: from_unix_ms(value),
            },
            other => anyhow::bail!("phone_code_verify.lua answered {other:?}"),
        })
    }
}

/// The digest Redis keeps instead of the code; salted with the phone so equal codes of different
/// phones differ.
fn code_digest(phone: &PhoneNumber, code: &str) -> String {
    URL_SAFE_NO_PAD.encode(Sha256::digest(format!("{phone}:{code}").as_bytes()))
}
