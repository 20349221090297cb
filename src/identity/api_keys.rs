//! API keys at run time: made (shown once), listed, revoked, and checked on every request that
//! carries one (`Authorization: Bearer zhk_...`). The user's stream is the truth
//! (`ApiKeyCreated`, `ApiKeyRevoked`, `domain/src/user/`); the key format is
//! `domain/src/api_key.rs`.
//!
//! Checking a key: its shape and checksum first, with no store at all (a typo costs nothing);
//! then Redis (`apikey:<digest>`, the valid keys only, for [`CACHE_TTL`]); on a miss the user's
//! stream is folded (the key names its user) and the answer cached. A cache only ever says
//! "valid": a revoke appends its event, then deletes the cached entry, so every instance refuses
//! the key from the revoke's answer on (a Redis that cannot be reached fails the revoke's answer,
//! not its event: the entry then expires within [`CACHE_TTL`]). A role change forgets every key
//! of the user, so an admin's key loses the admin scope with the role.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use rand::RngCore;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use uuid::Uuid;
use zhihui_domain::api_key::{MalformedKey, ParsedKey, Scope, new_key};
use zhihui_domain::user::{ApiKey, RegisteredUser, Role, UserCommand, UserId};

use crate::identity::users::{RegisterError, Users};
use crate::platform::clock::Clock;
use crate::platform::event_store::EventMetadata;
use crate::platform::redis_store::RedisStore;

/// How long Redis keeps a valid key's answer: bounds how long a revoke whose cache deletion
/// failed can go unseen.
pub const CACHE_TTL: Duration = Duration::from_secs(300);
/// A key's last use is written at most this often per key and process (a list shows it).
const LAST_USED_EVERY: Duration = Duration::from_secs(30);
/// The hash of every key's last use (key id -> Unix ms).
const LAST_USED_KEY: &str = "apikeys:last-used";

/// What a valid key lets its holder do: who, which key, which scopes, how fast.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyGrant {
    pub user_id: UserId,
    pub role: Role,
    pub key_id: Uuid,
    pub scopes: Vec<Scope>,
    pub expires_at: Option<DateTime<Utc>>,
    pub requests_per_minute: u32,
}

impl KeyGrant {
    pub fn allows(&self, scope: Scope) -> bool {
        // The admin scope is only ever an admin's, and only while they are one.
        self.scopes.contains(&scope) && (scope != Scope::Admin || self.role == Role::Admin)
    }
}

/// Why a key is refused.
#[derive(Debug, thiserror::Error)]
pub enum KeyRefusal {
    /// Not a key of ours: decided offline.
    #[error("this is not an API key of ours: {0}")]
    Malformed(MalformedKey),
    /// Well formed, but unknown, revoked or expired (which of them is not said).
    #[error("this API key is unknown, revoked or expired")]
    Unknown,
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}

/// A key to make.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub name: String,
    pub scopes: Vec<Scope>,
    pub expires_at: Option<DateTime<Utc>>,
    pub requests_per_minute: Option<u32>,
}

/// A key as its owner's list shows it (never the key).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct KeyView {
    pub key_id: Uuid,
    pub name: String,
    #[schema(value_type = Vec<String>)]
    pub scopes: Vec<Scope>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub requests_per_minute: u32,
    /// `active`, `revoked` or `expired`.
    pub state: &'static str,
}

#[derive(Debug, Clone)]
pub struct ApiKeys {
    redis: RedisStore,
    users: Users,
    clock: Clock,
    /// Requests a minute of a key made without its own figure, and the most a key may have.
    default_rate: u32,
    pub rate_max: u32,
    /// When this process last wrote each key's last use.
    last_noted: Arc<Mutex<HashMap<Uuid, Instant>>>,
}

impl ApiKeys {
    pub fn new(
        redis: RedisStore,
        users: Users,
        clock: Clock,
        default_rate: u32,
        rate_max: u32,
    ) -> ApiKeys {
        ApiKeys {
            redis,
            users,
            clock,
            default_rate,
            rate_max,
            last_noted: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn cache_key(&self, digest: &str) -> String {
        self.redis.key(&format!("apikey:{digest}"))
    }

    /// Make a key for `user_id`: recorded on their stream, returned once with its record.
    pub async fn create(
        &self,
        user_id: UserId,
        request: NewKey,
        metadata: &EventMetadata,
    ) -> Result<(String, ApiKey), RegisterError> {
        // The caller checked the figure against `rate_max` (the API names the field).
        let rate = request
            .requests_per_minute
            .unwrap_or(self.default_rate)
            .min(self.rate_max);
        let mut random = [0u8; 32];
        rand::rng().fill_bytes(&mut random);
        let (key, digest) = new_key(user_id, &random);
        let key_id = Uuid::now_v7();
        let command = UserCommand::CreateApiKey {
            key_id,
            name: request.name,
            scopes: request.scopes,
            digest: digest.clone(),
            expires_at: request.expires_at,
            requests_per_minute: rate,
            at: self.clock.now(),
        };
        let user = self.users.update(user_id, command, metadata).await?;
        let record = user
            .api_keys
            .iter()
            .find(|made| made.key_id == key_id)
            .cloned()
            .context("the key just made is on the stream")?;
        Ok((key, record))
    }

    /// Revoke a key of `user_id`: recorded, then forgotten by every instance's cache.
    pub async fn revoke(
        &self,
        user_id: UserId,
        key_id: Uuid,
        metadata: &EventMetadata,
    ) -> Result<ApiKey, RegisterError> {
        let user = self
            .users
            .update(
                user_id,
                UserCommand::RevokeApiKey {
                    key_id,
                    at: self.clock.now(),
                },
                metadata,
            )
            .await?;
        let key = user
            .api_keys
            .iter()
            .find(|key| key.key_id == key_id)
            .cloned()
            .context("the key just revoked is on the stream")?;
        self.forget(std::slice::from_ref(&key.digest)).await?;
        Ok(key)
    }

    /// Drop cached answers (a revoke, a role change).
    async fn forget(&self, digests: &[String]) -> anyhow::Result<()> {
        if digests.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = digests
            .iter()
            .map(|digest| self.cache_key(digest))
            .collect();
        let mut connection = self.redis.connection().await?;
        // One key at a time: in a cluster each cached key has a slot of its own.
        for key in keys {
            let _: i64 = connection
                .del(&key)
                .await
                .context("forgetting a cached API key")?;
        }
        self.redis.revocation_replicated(&mut connection).await
    }

    /// Forget every key of `user` (their role changed: the admin scope follows the role).
    pub async fn forget_user(&self, user: &RegisteredUser) -> anyhow::Result<()> {
        let digests: Vec<String> = user.api_keys.iter().map(|key| key.digest.clone()).collect();
        self.forget(&digests).await
    }

    /// Every key of `user_id`, newest first.
    pub async fn list(&self, user_id: UserId) -> anyhow::Result<Vec<KeyView>> {
        let Some(user) = self.users.get(user_id).await? else {
            return Ok(Vec::new());
        };
        let mut connection = self.redis.connection().await?;
        let ids: Vec<String> = user
            .api_keys
            .iter()
            .map(|key| key.key_id.to_string())
            .collect();
        let used: Vec<Option<i64>> = if ids.is_empty() {
            Vec::new()
        } else {
            redis::cmd("HMGET")
                .arg(self.redis.key(LAST_USED_KEY))
                .arg(&ids)
                .query_async(&mut connection)
                .await
                .context("reading keys' last use")?
        };
        let now = self.clock.now();
        let mut views: Vec<KeyView> = user
            .api_keys
            .iter()
            .zip(used.into_iter().chain(std::iter::repeat(None)))
            .map(|(key, used)| KeyView {
                key_id: key.key_id,
                name: key.name.clone(),
                scopes: key.scopes.clone(),
                created_at: key.created_at,
                expires_at: key.expires_at,
                revoked_at: key.revoked_at,
                last_used_at: used.map(crate::platform::clock::from_unix_ms),
                requests_per_minute: key.requests_per_minute,
                state: if key.revoked_at.is_some() {
                    "revoked"
                } else if key.is_active(now) {
                    "active"
                } else {
                    "expired"
                },
            })
            .collect();
        views.reverse();
        Ok(views)
    }

    /// The grant of a key, or why not: its shape first (no store), then the cache, then the
    /// user's stream.
    pub async fn authenticate(&self, text: &str) -> Result<KeyGrant, KeyRefusal> {
        let parsed = ParsedKey::parse(text).map_err(KeyRefusal::Malformed)?;
        let now = self.clock.now();
        let cache_key = self.cache_key(parsed.digest());
        let mut connection = self.redis.connection().await?;
        let cached: Option<String> = connection
            .get(&cache_key)
            .await
            .context("reading a cached API key")?;
        if let Some(json) = cached
            && let Ok(grant) = serde_json::from_str::<KeyGrant>(&json)
            && grant.user_id == parsed.user_id()
        {
            // Expiry is fixed at creation: a cached answer knows it.
            if grant.expires_at.is_some_and(|expires_at| now >= expires_at) {
                return Err(KeyRefusal::Unknown);
            }
            return Ok(grant);
        }
        let user = self
            .users
            .get(parsed.user_id())
            .await?
            .ok_or(KeyRefusal::Unknown)?;
        let key = user
            .api_key(parsed.digest())
            .filter(|key| key.is_active(now))
            .ok_or(KeyRefusal::Unknown)?;
        let grant = KeyGrant {
            user_id: user.user_id,
            role: user.role,
            key_id: key.key_id,
            scopes: key.scopes.clone(),
            expires_at: key.expires_at,
            requests_per_minute: key.requests_per_minute,
        };
        let json = serde_json::to_string(&grant).context("encoding a key's grant")?;
        let _: () = connection
            .set_ex(&cache_key, json, CACHE_TTL.as_secs())
            .await
            .context("caching an API key")?;
        Ok(grant)
    }

    /// Note that a key was used (at most every [`LAST_USED_EVERY`] per key in this process).
    pub async fn note_use(&self, key_id: Uuid) {
        let due = {
            let Ok(mut noted) = self.last_noted.lock() else {
                return;
            };
            let due = noted
                .get(&key_id)
                .is_none_or(|at| at.elapsed() >= LAST_USED_EVERY);
            if due {
                noted.insert(key_id, Instant::now());
            }
            due
        };
        if !due {
            return;
        }
        let written = async {
            let mut connection = self.redis.connection().await?;
            let _: i64 = connection
                .hset(
                    self.redis.key(LAST_USED_KEY),
                    key_id.to_string(),
                    self.clock.now_ms(),
                )
                .await
                .context("noting a key's use")?;
            anyhow::Ok(())
        };
        if let Err(error) = written.await {
            tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "a key's last use not noted");
        }
    }
}
