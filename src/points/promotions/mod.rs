//! Flash-sale promotions: the gate in Redis, the claims persisted through a Redis Stream.
//!
//! **The gate** (`POST /promotions/{id}/claims`) is one Lua step (`lua/promo_claim.lua`): the
//! window, the one-claim-per-user set, the stock decrement and the append of the claim to the
//! claims stream (`promo:claims`), so the answer (202 with a time-ordered claim id) needs one
//! round trip. Redis holds a promotion only as a cache of its stream: when it does not (a flush,
//! an expiry, never loaded) the gate loads it from the events (`lua/promo_load.lua`: units left
//! and the users holding a claim) and runs again.
//!
//! **Persistence**: every process runs a consumer in one consumer group. Each entry becomes, on
//! the promotion's stream (batched per stream by [`AggregateService`]), `ClaimReserved` (the
//! store's final guard: never more than the stock, never a user twice, decided on the latest
//! version), then the price charged on the account (if any), `ClaimGranted` (or `ClaimRefused`
//! when the price cannot be paid: its unit goes back to the gate), then the points credited, and
//! only then `XACK`. A claim the store cannot reserve (the promotion ended or sold out while the
//! gate's cache was a moment behind) is recorded as `ClaimTurnedAway` with its reason and its user
//! released at the gate: every accepted claim ends granted or refused, never pending for good. Every step is idempotent (operation ids from the claim id), so an entry
//! delivered twice moves points once. An entry whose consumer died is taken over (`XAUTOCLAIM`)
//! after `promotions.takeover_idle_ms`; one delivered `deliveries_max` times is parked in
//! `promotion_parked_claims` with its reason (never dropped). The settlement reconciler finishes
//! claims whose entry was lost midway (Redis flushed between two steps).

use std::collections::HashMap;

use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use serde::Serialize;
use uuid::Uuid;
use zhihui_domain::account::{Account, AccountCommand, AccountError, CreditKind, account_stream};
use zhihui_domain::promotion::{
    ClaimId, ClaimStatus, Promotion, PromotionCommand, PromotionError, PromotionEvent, PromotionId,
    PromotionSpec, PromotionState, charge_operation_id, claim_reference, credit_operation_id,
    promotion_stream,
};
use zhihui_domain::user::UserId;

use crate::platform::aggregate::AggregateService;
use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError};
use crate::platform::configuration::PromotionSettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata};
use crate::platform::notify::{Envelope, Notifier};
use crate::platform::redis_store::RedisStore;

mod consumer;
pub mod scripts;

/// The consumer group every process's consumer joins.
const GROUP: &str = "persist";
/// The actor of the events the consumers append.
pub const CONSUMER_ACTOR: &str = "system:promotion-consumer";

/// Why the gate refused a claim (each a named problem).
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("no such promotion")]
    Unknown,
    #[error("the promotion is open from {starts_at} until {ends_at}")]
    NotOpen {
        starts_at: DateTime<Utc>,
        ends_at: DateTime<Utc>,
    },
    #[error("sold out")]
    SoldOut,
    #[error("you have claimed this promotion already")]
    AlreadyClaimed,
    #[error(transparent)]
    Store(#[from] anyhow::Error),
}

/// What persisting one claim came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Granted,
    /// `insufficient-points`, `sold-out`, `already-claimed`, `not-open`, `unknown-promotion`.
    Refused(String),
}

/// One entry of the claims stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimEntry {
    pub claim_id: ClaimId,
    pub promotion_id: PromotionId,
    pub user_id: UserId,
    pub accepted_at: DateTime<Utc>,
}

impl ClaimEntry {
    pub fn parse(entry: &StreamId) -> anyhow::Result<ClaimEntry> {
        let field = |name: &str| -> anyhow::Result<String> {
            entry
                .get::<String>(name)
                .with_context(|| format!("entry {} has no {name}", entry.id))
        };
        Ok(ClaimEntry {
            claim_id: Uuid::parse_str(&field("claim")?)?,
            promotion_id: Uuid::parse_str(&field("promotion")?)?,
            user_id: UserId::from_uuid(Uuid::parse_str(&field("user")?)?),
            accepted_at: crate::platform::clock::from_unix_ms(field("at")?.parse()?),
        })
    }
}

/// A user's claim as they see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MyClaim {
    pub claim_id: Option<ClaimId>,
    /// `pending` (accepted, not persisted yet), `granted` or `refused`.
    pub status: &'static str,
    pub reason: Option<String>,
}

/// What one consumer step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumeReport {
    pub read: usize,
    pub acknowledged: usize,
    pub failed: usize,
    pub parked: usize,
}

#[derive(Debug, Clone)]
pub struct PromotionService {
    store: AnyEventStore,
    promotions: AggregateService<Promotion>,
    accounts: AggregateService<Account>,
    pool: Pool,
    redis: RedisStore,
    clock: Clock,
    notifier: Notifier,
    settings: PromotionSettings,
    /// The consumer's own connection for its blocking reads: a blocked `XREADGROUP` on the
    /// shared multiplexed connection would hold every other command of the process behind it.
    blocking:
        std::sync::Arc<tokio::sync::Mutex<Option<crate::platform::redis_store::RedisConnection>>>,
}

/// The hash tag of every promotion key (see `PromotionService::hash_key`).
const PROMO_TAG: &str = "promo";

fn metadata() -> EventMetadata {
    EventMetadata {
        correlation_id: Uuid::now_v7(),
        causation_id: None,
        actor: CONSUMER_ACTOR.into(),
    }
}

impl PromotionService {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: AnyEventStore,
        promotions: AggregateService<Promotion>,
        accounts: AggregateService<Account>,
        pool: Pool,
        redis: RedisStore,
        clock: Clock,
        notifier: Notifier,
        settings: PromotionSettings,
    ) -> PromotionService {
        PromotionService {
            store,
            promotions,
            accounts,
            pool,
            redis,
            clock,
            notifier,
            settings,
            blocking: std::sync::Arc::default(),
        }
    }

    pub fn settings(&self) -> &PromotionSettings {
        &self.settings
    }

    // Every promotion key shares one hash tag: a claim takes a unit and appends the claim to the
    // one stream the consumers read in the same script (so a unit is never taken without its
    // claim recorded), and a sale's load falls on one promotion, whose keys are one slot however
    // they are tagged.

    fn hash_key(&self, promotion_id: PromotionId) -> String {
        self.redis.tagged(PROMO_TAG, &promotion_id.to_string())
    }

    fn users_key(&self, promotion_id: PromotionId) -> String {
        self.redis
            .tagged(PROMO_TAG, &format!("{promotion_id}:users"))
    }

    pub fn stream_key(&self) -> String {
        self.redis.tagged(PROMO_TAG, "claims")
    }

    // -----------------------------------------------------------------------------------------
    // Admin: create, end, raise the stock.

    pub async fn execute(
        &self,
        promotion_id: PromotionId,
        command: PromotionCommand,
        metadata: EventMetadata,
    ) -> Result<PromotionState, CommandError<PromotionError>> {
        let handled = self
            .promotions
            .execute(&promotion_stream(promotion_id), command.clone(), metadata)
            .await?;
        let state = handled
            .state_after
            .ok_or(CommandError::Rejected(PromotionError::Unknown))?;
        if !handled.new_events.is_empty() {
            // Redis follows the store; when it cannot, the promotion is dropped from Redis and the
            // next claim loads it again.
            let adjusted = match command {
                PromotionCommand::RaiseStock { by, .. } => {
                    self.adjust(promotion_id, "raise", &by.to_string()).await
                }
                PromotionCommand::End { at } => {
                    self.adjust(promotion_id, "end", &at.timestamp_millis().to_string())
                        .await
                }
                _ => Ok(()),
            };
            if let Err(error) = adjusted {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), %promotion_id, "promotion not changed in Redis; dropping it there");
                if let Ok(mut connection) = self.redis.connection().await {
                    let _: redis::RedisResult<i64> = redis::cmd("DEL")
                        .arg(self.hash_key(promotion_id))
                        .arg(self.users_key(promotion_id))
                        .query_async(&mut connection)
                        .await;
                }
            }
        }
        Ok(state)
    }

    async fn adjust(
        &self,
        promotion_id: PromotionId,
        operation: &str,
        value: &str,
    ) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _: i64 = crate::points::promotions::scripts::PROMO_ADJUST
            .key(self.hash_key(promotion_id))
            .key(self.users_key(promotion_id))
            .arg(operation)
            .arg(value)
            .invoke_async(&mut connection)
            .await
            .context("adjusting a promotion in Redis")?;
        Ok(())
    }

    pub async fn create(
        &self,
        promotion_id: PromotionId,
        spec: PromotionSpec,
        metadata: EventMetadata,
    ) -> Result<PromotionState, CommandError<PromotionError>> {
        let at = self.clock.now();
        self.execute(
            promotion_id,
            PromotionCommand::Create {
                promotion_id,
                spec,
                at,
            },
            metadata,
        )
        .await
    }

    /// The promotion on its stream's latest version.
    pub async fn load(&self, promotion_id: PromotionId) -> anyhow::Result<Option<PromotionState>> {
        Ok(
            command::load::<Promotion>(&self.store, &promotion_stream(promotion_id))
                .await?
                .state,
        )
    }

    // -----------------------------------------------------------------------------------------
    // The gate.

    /// Claim a promotion for `user_id`: accepted (the claim id; persisted in the background) or
    /// refused at once.
    pub async fn claim(
        &self,
        user_id: UserId,
        promotion_id: PromotionId,
    ) -> Result<ClaimId, ClaimError> {
        let claim_id = Uuid::now_v7();
        for _ in 0..2 {
            let now = self.clock.now();
            let mut connection = self.redis.connection().await?;
            let answer: Vec<String> = crate::points::promotions::scripts::PROMO_CLAIM
                .key(self.hash_key(promotion_id))
                .key(self.users_key(promotion_id))
                .key(self.stream_key())
                .arg(user_id.to_string())
                .arg(claim_id.to_string())
                .arg(now.timestamp_millis())
                .arg(promotion_id.to_string())
                .arg(self.settings.stream_length_max)
                .invoke_async(&mut connection)
                .await
                .context("running the claim gate")?;
            match answer.first().map(String::as_str) {
                Some("ok") => return Ok(claim_id),
                Some("sold-out") => return Err(ClaimError::SoldOut),
                Some("already-claimed") => return Err(ClaimError::AlreadyClaimed),
                Some("not-open") => {
                    let ms = |index: usize| -> anyhow::Result<DateTime<Utc>> {
                        Ok(crate::platform::clock::from_unix_ms(
                            answer
                                .get(index)
                                .context("the gate's window")?
                                .parse()
                                .context("a time from the gate")?,
                        ))
                    };
                    return Err(ClaimError::NotOpen {
                        starts_at: ms(1)?,
                        ends_at: ms(2)?,
                    });
                }
                Some("miss") => {
                    if !self.load_into_redis(promotion_id).await? {
                        return Err(ClaimError::Unknown);
                    }
                }
                _ => return Err(anyhow::anyhow!("the claim gate answered {answer:?}").into()),
            }
        }
        Err(
            anyhow::anyhow!("promotion {promotion_id} vanished from Redis twice while claiming")
                .into(),
        )
    }

    /// Load a promotion into Redis from its stream; false when there is no such promotion.
    pub async fn load_into_redis(&self, promotion_id: PromotionId) -> anyhow::Result<bool> {
        let Some(promotion) = self.load(promotion_id).await? else {
            return Ok(false);
        };
        let keep_until = promotion.spec.ends_at
            + chrono::Duration::milliseconds(
                i64::try_from(self.settings.redis_keep_after_end_ms).unwrap_or(i64::MAX),
            );
        let keep_ms = (keep_until - self.clock.now())
            .num_milliseconds()
            .max(60_000);
        let mut script = crate::points::promotions::scripts::PROMO_LOAD.prepare_invoke();
        script
            .key(self.hash_key(promotion_id))
            .key(self.users_key(promotion_id))
            .arg(promotion.left())
            .arg(promotion.spec.starts_at.timestamp_millis())
            .arg(promotion.spec.ends_at.timestamp_millis())
            .arg(promotion.ended_at.map_or(0, |at| at.timestamp_millis()))
            .arg(keep_ms);
        for (user, claim) in &promotion.claims {
            if claim.status != ClaimStatus::Refused {
                script.arg(user.to_string());
            }
        }
        let mut connection = self.redis.connection().await?;
        let _: i64 = script
            .invoke_async(&mut connection)
            .await
            .context("loading a promotion into Redis")?;
        Ok(true)
    }

    /// Units left at the gate, when Redis holds the promotion.
    pub async fn left_in_redis(&self, promotion_id: PromotionId) -> anyhow::Result<Option<i64>> {
        let mut connection = self.redis.connection().await?;
        redis::cmd("HGET")
            .arg(self.hash_key(promotion_id))
            .arg("left")
            .query_async(&mut connection)
            .await
            .context("reading units left")
    }

    /// The caller's claim: persisted (from the read model), else pending when the gate holds
    /// the user, else none.
    pub async fn my_claim(
        &self,
        user_id: UserId,
        promotion_id: PromotionId,
    ) -> anyhow::Result<Option<MyClaim>> {
        let row = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query_opt(
                    "SELECT claim_id, status, reason FROM promotion_claims
                      WHERE promotion_id = $1 AND user_id = $2
                      ORDER BY accepted_at DESC, claim_id DESC LIMIT 1",
                    &[&promotion_id, &user_id.as_uuid()],
                )
                .await
                .context("reading the user's claim")?
        };
        let mut connection = self.redis.connection().await?;
        let at_gate: bool = redis::cmd("SISMEMBER")
            .arg(self.users_key(promotion_id))
            .arg(user_id.to_string())
            .query_async(&mut connection)
            .await
            .context("reading the gate's users")?;
        Ok(match row {
            Some(row) => {
                let status: String = row.get(1);
                Some(match status.as_str() {
                    "granted" => MyClaim {
                        claim_id: Some(row.get(0)),
                        status: "granted",
                        reason: None,
                    },
                    // A refused claim whose user the gate holds again: a newer claim pending.
                    "refused" if at_gate => MyClaim {
                        claim_id: None,
                        status: "pending",
                        reason: None,
                    },
                    "refused" => MyClaim {
                        claim_id: Some(row.get(0)),
                        status: "refused",
                        reason: row.get(2),
                    },
                    _ => MyClaim {
                        claim_id: Some(row.get(0)),
                        status: "pending",
                        reason: None,
                    },
                })
            }
            None if at_gate => Some(MyClaim {
                claim_id: None,
                status: "pending",
                reason: None,
            }),
            None => None,
        })
    }

    // -----------------------------------------------------------------------------------------
    // Persistence.
}
