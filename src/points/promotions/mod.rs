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
//! only then `XACK`. Every step is idempotent (operation ids from the claim id), so an entry
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
    ClaimId, ClaimStatus, Promotion, PromotionCommand, PromotionError, PromotionId, PromotionSpec,
    PromotionState, charge_operation_id, claim_reference, credit_operation_id, promotion_stream,
};
use zhihui_domain::user::UserId;

use crate::platform::aggregate::AggregateService;
use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError};
use crate::platform::configuration::PromotionSettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata};
use crate::platform::notify::{Envelope, Notifier};
use crate::platform::redis_store::RedisStore;

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
        let _: i64 = crate::platform::lua::PROMO_ADJUST
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
            let answer: Vec<String> = crate::platform::lua::PROMO_CLAIM
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
        let mut script = crate::platform::lua::PROMO_LOAD.prepare_invoke();
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

    /// Persist one accepted claim: reserve its unit, charge its price, grant it, credit its
    /// points. Idempotent: a repeat moves nothing twice.
    pub async fn persist(&self, entry: &ClaimEntry) -> anyhow::Result<Outcome> {
        let stream = promotion_stream(entry.promotion_id);
        let now = self.clock.now();
        let reserved = self
            .promotions
            .execute(
                &stream,
                PromotionCommand::Reserve {
                    claim_id: entry.claim_id,
                    user_id: entry.user_id,
                    accepted_at: entry.accepted_at,
                    at: now,
                },
                metadata(),
            )
            .await;
        let state = match reserved {
            Ok(handled) => handled.state_after.context("a reserved promotion")?,
            Err(CommandError::Rejected(error)) => {
                let reason = match error {
                    PromotionError::SoldOut => "sold-out",
                    PromotionError::AlreadyClaimed => "already-claimed",
                    PromotionError::NotOpen { .. } | PromotionError::Ended => "not-open",
                    PromotionError::Unknown => "unknown-promotion",
                    // Refused before (a repeat of this claim).
                    PromotionError::NotPending(_) => "refused",
                    other => {
                        return Err(anyhow::anyhow!(
                            "reserving claim {}: {other}",
                            entry.claim_id
                        ));
                    }
                };
                self.tell(entry, &Outcome::Refused(reason.into())).await;
                return Ok(Outcome::Refused(reason.into()));
            }
            Err(error) => {
                return Err(anyhow::anyhow!(
                    "reserving claim {}: {error}",
                    entry.claim_id
                ));
            }
        };
        let status = state
            .claims
            .get(&entry.user_id)
            .filter(|claim| claim.claim_id == entry.claim_id)
            .map(|claim| claim.status)
            .context("a reserved claim is in its promotion")?;
        let status = if status == ClaimStatus::Reserved {
            self.pay_and_grant(entry, &state).await?
        } else {
            status
        };
        let outcome = match status {
            ClaimStatus::Granted => {
                self.credit(entry, &state).await?;
                Outcome::Granted
            }
            ClaimStatus::Refused => Outcome::Refused("insufficient-points".into()),
            ClaimStatus::Reserved => anyhow::bail!("claim {} still reserved", entry.claim_id),
        };
        self.tell(entry, &outcome).await;
        Ok(outcome)
    }

    /// Charge the price (if any); grant, or refuse when it cannot be paid (and give the unit
    /// back to the gate).
    async fn pay_and_grant(
        &self,
        entry: &ClaimEntry,
        state: &PromotionState,
    ) -> anyhow::Result<ClaimStatus> {
        let stream = promotion_stream(entry.promotion_id);
        if let Some(price) = state.spec.price {
            let charged = self
                .accounts
                .execute(
                    &account_stream(entry.user_id),
                    AccountCommand::Charge {
                        operation_id: charge_operation_id(entry.claim_id),
                        amount: price,
                        reason: claim_reference(entry.promotion_id, entry.claim_id),
                        at: self.clock.now(),
                    },
                    metadata(),
                )
                .await;
            match charged {
                Ok(_) => {}
                Err(CommandError::Rejected(AccountError::InsufficientPoints { .. })) => {
                    let refused = self
                        .promotions
                        .execute(
                            &stream,
                            PromotionCommand::Refuse {
                                claim_id: entry.claim_id,
                                user_id: entry.user_id,
                                reason: "insufficient-points".into(),
                                at: self.clock.now(),
                            },
                            metadata(),
                        )
                        .await
                        .map_err(|error| {
                            anyhow::anyhow!("refusing claim {}: {error}", entry.claim_id)
                        })?;
                    if !refused.new_events.is_empty()
                        && let Err(error) = self
                            .adjust(entry.promotion_id, "release", &entry.user_id.to_string())
                            .await
                    {
                        tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "a refused claim's unit not given back to the gate");
                    }
                    return Ok(ClaimStatus::Refused);
                }
                Err(error) => anyhow::bail!("charging claim {}: {error}", entry.claim_id),
            }
        }
        self.promotions
            .execute(
                &stream,
                PromotionCommand::Grant {
                    claim_id: entry.claim_id,
                    user_id: entry.user_id,
                    at: self.clock.now(),
                },
                metadata(),
            )
            .await
            .map_err(|error| anyhow::anyhow!("granting claim {}: {error}", entry.claim_id))?;
        Ok(ClaimStatus::Granted)
    }

    async fn credit(&self, entry: &ClaimEntry, state: &PromotionState) -> anyhow::Result<()> {
        self.accounts
            .execute(
                &account_stream(entry.user_id),
                AccountCommand::Credit {
                    operation_id: credit_operation_id(entry.claim_id),
                    kind: CreditKind::Promotion,
                    amount: state.spec.points,
                    reference: claim_reference(entry.promotion_id, entry.claim_id),
                    at: self.clock.now(),
                },
                metadata(),
            )
            .await
            .map_err(|error| anyhow::anyhow!("crediting claim {}: {error}", entry.claim_id))?;
        Ok(())
    }

    async fn tell(&self, entry: &ClaimEntry, outcome: &Outcome) {
        let envelope = Envelope::Claim {
            user_id: entry.user_id.as_uuid(),
            promotion_id: entry.promotion_id,
            claim_id: entry.claim_id,
            granted: *outcome == Outcome::Granted,
            reason: match outcome {
                Outcome::Granted => None,
                Outcome::Refused(reason) => Some(reason.clone()),
            },
        };
        if let Err(error) = self.notifier.publish(&envelope).await {
            tracing::debug!(error = %crate::platform::telemetry::error_chain(&error), "claim notification not published");
        }
    }

    // -----------------------------------------------------------------------------------------
    // The consumer.

    async fn ensure_group(
        &self,
        connection: &mut crate::platform::redis_store::RedisConnection,
    ) -> anyhow::Result<()> {
        let created: redis::RedisResult<String> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(self.stream_key())
            .arg(GROUP)
            // From the stream's start: after a flush, the gate recreates the stream before any
            // consumer recreates the group, and those first entries must be read too.
            .arg("0")
            .arg("MKSTREAM")
            .query_async(connection)
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
            Err(error) => Err(error).context("creating the consumer group"),
        }
    }

    /// Read new entries for `consumer` (waiting up to `block_ms` when given) and persist them
    /// concurrently; acknowledge each persisted one.
    pub async fn consume_once(
        &self,
        consumer: &str,
        block_ms: Option<u64>,
    ) -> anyhow::Result<ConsumeReport> {
        let mut connection = self.redis.connection().await?;
        self.ensure_group(&mut connection).await?;
        let mut read = redis::cmd("XREADGROUP");
        read.arg("GROUP")
            .arg(GROUP)
            .arg(consumer)
            .arg("COUNT")
            .arg(self.settings.consumer_batch);
        if let Some(block_ms) = block_ms {
            read.arg("BLOCK").arg(block_ms);
        }
        read.arg("STREAMS").arg(self.stream_key()).arg(">");
        let answer = if block_ms.is_some() {
            let mut dedicated = self.blocking.lock().await;
            if dedicated.is_none() {
                // Its answers take up to the whole block: each read gets its own timeout below.
                *dedicated = Some(self.redis.blocking_connection().await?);
            }
            let reader = dedicated.as_mut().context("the consumer's connection")?;
            let limit = std::time::Duration::from_millis(block_ms.unwrap_or(0) + 2_000);
            let Ok(answer) = tokio::time::timeout(limit, read.query_async(reader)).await else {
                *dedicated = None;
                anyhow::bail!("reading claims: no answer within {limit:?}");
            };
            if answer
                .as_ref()
                .is_err_and(|error| error.is_io_error() || error.is_timeout())
            {
                *dedicated = None;
            }
            answer
        } else {
            read.query_async(&mut connection).await
        };
        let reply: Option<StreamReadReply> = match answer {
            Ok(reply) => reply,
            // The group vanished with a flush: made again on the next step.
            Err(error) if error.code() == Some("NOGROUP") => return Ok(ConsumeReport::default()),
            Err(error) => return Err(error).context("reading claims"),
        };
        let entries: Vec<StreamId> = reply
            .map(|reply| reply.keys.into_iter().flat_map(|key| key.ids).collect())
            .unwrap_or_default();
        self.handle(&mut connection, entries).await
    }

    /// Park entries delivered `deliveries_max` times, then take over the entries idle for
    /// `takeover_idle_ms` (their consumer died) and persist them.
    pub async fn take_over_once(&self, consumer: &str) -> anyhow::Result<ConsumeReport> {
        let mut connection = self.redis.connection().await?;
        self.ensure_group(&mut connection).await?;
        let idle = self.settings.takeover_idle_ms;
        let pending: StreamPendingCountReply = redis::cmd("XPENDING")
            .arg(self.stream_key())
            .arg(GROUP)
            .arg("IDLE")
            .arg(idle)
            .arg("-")
            .arg("+")
            .arg(self.settings.consumer_batch)
            .query_async(&mut connection)
            .await
            .context("reading pending claims")?;
        let mut parked = 0;
        for over in pending
            .ids
            .iter()
            .filter(|pending| pending.times_delivered as u64 >= self.settings.deliveries_max)
        {
            self.park(&mut connection, &over.id, over.times_delivered as u64)
                .await?;
            parked += 1;
        }
        let claimed: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(self.stream_key())
            .arg(GROUP)
            .arg(consumer)
            .arg(idle)
            .arg("0-0")
            .arg("COUNT")
            .arg(self.settings.consumer_batch)
            .query_async(&mut connection)
            .await
            .context("taking pending claims over")?;
        let mut report = self.handle(&mut connection, claimed.claimed).await?;
        report.parked += parked;
        Ok(report)
    }

    async fn handle(
        &self,
        connection: &mut crate::platform::redis_store::RedisConnection,
        entries: Vec<StreamId>,
    ) -> anyhow::Result<ConsumeReport> {
        let mut report = ConsumeReport {
            read: entries.len(),
            ..ConsumeReport::default()
        };
        let results = futures::future::join_all(entries.iter().map(|entry| async move {
            let parsed = ClaimEntry::parse(entry)?;
            self.persist(&parsed).await
        }))
        .await;
        let mut acknowledged = Vec::new();
        for (entry, result) in entries.iter().zip(results) {
            match result {
                Ok(_) => acknowledged.push(entry.id.clone()),
                Err(error) => {
                    report.failed += 1;
                    tracing::warn!(entry = %entry.id, error = %crate::platform::telemetry::error_chain(&error), "claim not persisted; it will be delivered again");
                }
            }
        }
        if !acknowledged.is_empty() {
            let _: i64 = redis::cmd("XACK")
                .arg(self.stream_key())
                .arg(GROUP)
                .arg(&acknowledged)
                .query_async(connection)
                .await
                .context("acknowledging claims")?;
        }
        report.acknowledged = acknowledged.len();
        Ok(report)
    }

    /// Keep an entry that keeps failing in `promotion_parked_claims`, then acknowledge it.
    async fn park(
        &self,
        connection: &mut crate::platform::redis_store::RedisConnection,
        id: &str,
        deliveries: u64,
    ) -> anyhow::Result<()> {
        let entries: Vec<StreamId> = {
            let range: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
                .arg(self.stream_key())
                .arg(id)
                .arg(id)
                .query_async(connection)
                .await
                .context("reading a claim to park")?;
            range.ids
        };
        let (text, parsed, promotion_id) = match entries.first() {
            Some(entry) => (
                format!("{:?}", entry.map),
                ClaimEntry::parse(entry).map_err(|error| format!("unreadable entry: {error:#}")),
                entry
                    .get::<String>("promotion")
                    .and_then(|text| Uuid::parse_str(&text).ok()),
            ),
            None => (
                "(trimmed)".into(),
                Err("the entry is no longer in the stream".into()),
                None,
            ),
        };
        let reason = match &parsed {
            Ok(entry) => match self.persist(entry).await {
                Ok(_) => None,
                Err(error) => Some(crate::platform::telemetry::error_chain(&error).to_string()),
            },
            Err(error) => Some(error.clone()),
        };
        if let Some(reason) = reason {
            let parsed = parsed.ok();
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .execute(
                    "INSERT INTO promotion_parked_claims
                        (claim_id, promotion_id, user_id, entry, reason, deliveries, parked_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)
                     ON CONFLICT (claim_id) DO UPDATE
                        SET reason = EXCLUDED.reason, deliveries = EXCLUDED.deliveries",
                    &[
                        &parsed
                            .as_ref()
                            .map_or_else(Uuid::now_v7, |entry| entry.claim_id),
                        &parsed
                            .as_ref()
                            .map(|entry| entry.promotion_id)
                            .or(promotion_id),
                        &parsed.as_ref().map(|entry| entry.user_id.as_uuid()),
                        &text,
                        &reason,
                        &i64::try_from(deliveries).unwrap_or(i64::MAX),
                        &self.clock.now(),
                    ],
                )
                .await
                .context("parking a claim")?;
            tracing::error!(entry = %id, %reason, "claim parked after {deliveries} deliveries");
        }
        let _: i64 = redis::cmd("XACK")
            .arg(self.stream_key())
            .arg(GROUP)
            .arg(id)
            .query_async(connection)
            .await
            .context("acknowledging a parked claim")?;
        Ok(())
    }

    /// Run the consumer forever as `consumer` (this process): new entries as they come, and the
    /// entries of dead consumers after the idle bound.
    pub async fn run_consumer(self, consumer: String) {
        let mut last_takeover = std::time::Instant::now();
        let takeover_every =
            std::time::Duration::from_millis(self.settings.takeover_idle_ms / 2 + 1);
        loop {
            if let Err(error) = self
                .consume_once(&consumer, Some(self.settings.consumer_block_ms))
                .await
            {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "claims consumer step failed");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            if last_takeover.elapsed() >= takeover_every {
                last_takeover = std::time::Instant::now();
                if let Err(error) = self.take_over_once(&consumer).await {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "claims takeover failed");
                }
            }
        }
    }

    /// Claims persisted only partly (their stream entry lost midway, e.g. Redis flushed) and
    /// accepted more than `after` ago: persist them again from the store. Returns the claims
    /// finished (claim, user, accepted at).
    pub async fn repair_once(
        &self,
        after: chrono::Duration,
        limit: i64,
    ) -> anyhow::Result<Vec<(ClaimId, Uuid, DateTime<Utc>)>> {
        let cutoff = self.clock.now() - after;
        let rows = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query(
                    "SELECT claim_id, promotion_id, user_id, accepted_at FROM promotion_claims
                      WHERE (status = 'reserved' OR (status = 'granted' AND credited_at IS NULL))
                        AND accepted_at <= $1
                      ORDER BY accepted_at LIMIT $2",
                    &[&cutoff, &limit],
                )
                .await
                .context("reading unsettled claims")?
        };
        let mut repaired = Vec::new();
        for row in rows {
            let entry = ClaimEntry {
                claim_id: row.get(0),
                promotion_id: row.get(1),
                user_id: UserId::from_uuid(row.get(2)),
                accepted_at: row.get(3),
            };
            self.persist(&entry).await?;
            repaired.push((entry.claim_id, entry.user_id.as_uuid(), entry.accepted_at));
        }
        Ok(repaired)
    }

    /// Parked claims of a promotion (all when `None`): (claim, user, reason, deliveries).
    pub async fn parked(
        &self,
        promotion_id: Option<PromotionId>,
    ) -> anyhow::Result<Vec<HashMap<&'static str, String>>> {
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        let rows = client
            .query(
                "SELECT claim_id, user_id, reason, deliveries, parked_at FROM promotion_parked_claims
                  WHERE $1::uuid IS NULL OR promotion_id = $1 ORDER BY parked_at",
                &[&promotion_id],
            )
            .await
            .context("reading parked claims")?;
        Ok(rows
            .iter()
            .map(|row| {
                HashMap::from([
                    ("claim_id", row.get::<_, Uuid>(0).to_string()),
                    (
                        "user_id",
                        row.get::<_, Option<Uuid>>(1)
                            .map(|id| id.to_string())
                            .unwrap_or_default(),
                    ),
                    ("reason", row.get(2)),
                    ("deliveries", row.get::<_, i64>(3).to_string()),
                    ("parked_at", row.get::<_, DateTime<Utc>>(4).to_rfc3339()),
                ])
            })
            .collect())
    }
}
