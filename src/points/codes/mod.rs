//! Redeem codes: batches (create, issue in pages, revoke, export) and redemption.
//!
//! Redemption, fast path: the code's signature is checked in memory (a forged or mistyped code
//! never reaches PostgreSQL or Redis; such failures are counted in this process's memory); then
//! one Lua step in Redis (`lua/code_redeem.lua`) checks the user's failure limit and the cached
//! batch (issued, not revoked, inside its window) and sets the code's redeemed marker. Redis is
//! a cache: when it does not hold the batch (flushed, evicted, never loaded) the batch is loaded
//! from its stream and the step runs again, and whatever the marker says, the store decides.
//! The batch's latest event is read first, so a revocation counts even if Redis lost its mark (a
//! failover) or never had it. Then, on PostgreSQL, one append: the credit on the redeemer's
//! account under the event id derived from the code, which the log holds once (another account
//! is refused by the store, the same one is a repeat of its operation). Where event ids are
//! unique per stream only (KurrentDB), the code's own stream decides first (the first
//! `CodeRedeemed` append, expected version "no stream", wins) and the credit follows in a second
//! append; if the process dies between the two, the user's retry or the settlement reconciler
//! ([`CodeService::repair_credits_once`]) credits it. Codes redeemed that way before still have
//! their stream, which still decides them.

pub mod issuer;
pub mod scripts;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use actix_web::web::Bytes;
use anyhow::Context;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use futures::Stream;
use uuid::Uuid;
use zhihui_domain::account::{Account, AccountCommand, AccountState, CreditKind, account_stream};
use zhihui_domain::redeem::{
    Batch, BatchCommand, BatchError, BatchId, BatchSpec, CodeBatch, CodeKeys, CodeRedeemed,
    CodeRedemption, RedemptionCommand, RedemptionError, SERIALS_STREAM, SerialAllocator,
    SerialsCommand, SerialsError, batch_stream, code_stream, credit_event_id, credit_operation_id,
    credit_reference,
};
use zhihui_domain::user::UserId;

use crate::platform::aggregate::AggregateService;
use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError, RetryPolicy};
use crate::platform::configuration::CodeSettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata, EventStoreError};
use crate::platform::redis_store::RedisStore;

mod redeem;
use redeem::*;

/// Users whose forged attempts this process remembers, at most (a bound on memory; the oldest
/// windows are dropped first).
const FORGED_USERS_MAX: usize = 100_000;

/// Why a redemption was refused (each maps to a named problem).
#[derive(Debug, thiserror::Error)]
pub enum RedeemError {
    #[error("this is not a valid code")]
    Invalid,
    #[error("too many failed redemptions; try again later")]
    Limited { retry_at: DateTime<Utc> },
    #[error("no such code")]
    Unknown,
    #[error("the code can be redeemed from {valid_from} until {valid_until}")]
    NotValidNow {
        valid_from: DateTime<Utc>,
        valid_until: DateTime<Utc>,
    },
    #[error("the code's batch was revoked")]
    Revoked,
    #[error("the code was redeemed by another user")]
    RedeemedByAnother,
    #[error("the code's stream stayed contended")]
    Contended,
    #[error(transparent)]
    Store(#[from] anyhow::Error),
}

impl RedeemError {
    /// Failures that count towards the user's limit (guesses, not our own troubles).
    fn counts(&self) -> bool {
        matches!(
            self,
            RedeemError::Unknown
                | RedeemError::NotValidNow { .. }
                | RedeemError::Revoked
                | RedeemError::RedeemedByAnother
        )
    }
}

/// A successful redemption (also a repeat by the same user).
#[derive(Debug, Clone)]
pub struct Redemption {
    pub serial: u32,
    pub batch_id: BatchId,
    pub points: zhihui_domain::points::Amount,
    /// False when the caller had redeemed it before.
    pub redeemed_now: bool,
    pub account: AccountState,
}

/// Why a batch command was refused.
#[derive(Debug, thiserror::Error)]
pub enum BatchCommandError {
    #[error(transparent)]
    Batch(#[from] BatchError),
    #[error(transparent)]
    Serials(#[from] SerialsError),
    #[error("stream {0} stayed contended")]
    Contended(String),
    #[error(transparent)]
    Store(#[from] anyhow::Error),
}

impl<E> From<CommandError<E>> for BatchCommandError
where
    BatchCommandError: From<E>,
{
    fn from(error: CommandError<E>) -> Self {
        match error {
            CommandError::Rejected(error) => error.into(),
            CommandError::Contended { stream, .. } => BatchCommandError::Contended(stream),
            CommandError::Store(error) => BatchCommandError::Store(error),
        }
    }
}

#[derive(Debug, Clone)]
pub struct CodeService {
    store: AnyEventStore,
    accounts: AggregateService<Account>,
    pool: Pool,
    redis: RedisStore,
    clock: Clock,
    keys: Arc<CodeKeys>,
    settings: CodeSettings,
    /// Forged or malformed attempts per user in this process, counted without IO: (window
    /// start, attempts in the window, attempts not yet added to the user's counter in Redis).
    forged: Arc<Mutex<HashMap<UserId, Forged>>>,
    /// Batches created by this process, for its generator to start at once.
    pub(crate) created: issuer::Wake,
    /// Whether the log holds redemptions in codes' own streams (see
    /// `legacy_redemptions_exist`), once asked.
    legacy_redemptions: Arc<tokio::sync::OnceCell<bool>>,
}

impl CodeService {
    pub fn new(
        store: AnyEventStore,
        accounts: AggregateService<Account>,
        pool: Pool,
        redis: RedisStore,
        clock: Clock,
        settings: CodeSettings,
    ) -> anyhow::Result<CodeService> {
        Ok(CodeService {
            keys: Arc::new(settings.code_keys()?),
            store,
            accounts,
            pool,
            redis,
            clock,
            settings,
            forged: Arc::default(),
            created: issuer::Wake::default(),
            legacy_redemptions: Arc::default(),
        })
    }

    pub fn keys(&self) -> &CodeKeys {
        &self.keys
    }

    pub fn settings(&self) -> &CodeSettings {
        &self.settings
    }

    pub fn store(&self) -> &AnyEventStore {
        &self.store
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    // -----------------------------------------------------------------------------------------
    // Batches.

    /// Create a batch: reserve its serials, record it, cache it; its codes are issued in the
    /// background. Idempotent by `batch_id` (same spec: the same batch back).
    pub async fn create_batch(
        &self,
        batch_id: BatchId,
        spec: BatchSpec,
        metadata: &EventMetadata,
    ) -> Result<Batch, BatchCommandError> {
        spec.check().map_err(BatchError::from)?;
        let reserved = command::execute::<SerialAllocator>(
            &self.store,
            SERIALS_STREAM,
            &SerialsCommand::Reserve {
                batch_id,
                count: spec.count,
                at: self.clock.now(),
            },
            metadata,
            RetryPolicy::default(),
        )
        .await?;
        let (first_serial, _) = *reserved
            .state
            .reserved
            .get(&batch_id)
            .context("the reservation is in the allocator's state")?;
        let created = command::execute::<CodeBatch>(
            &self.store,
            &batch_stream(batch_id),
            &BatchCommand::Create {
                batch_id,
                spec,
                key_slot: self.keys.active_slot(),
                first_serial,
                at: self.clock.now(),
            },
            metadata,
            RetryPolicy::default(),
        )
        .await?;
        let batch = created.state.context("a created batch has state")?;
        self.created.push(batch_id);
        Ok(batch)
    }

    /// A batch on its latest version, with its stream version.
    pub async fn batch(&self, batch_id: BatchId) -> anyhow::Result<Option<(Batch, u64)>> {
        let loaded = command::load::<CodeBatch>(&self.store, &batch_stream(batch_id)).await?;
        Ok(loaded.state.zip(loaded.version))
    }

    /// Whether the batch's stream ends with its revocation (one event read, newest first:
    /// nothing follows a revocation).
    async fn revoked_in_store(&self, batch_id: BatchId) -> anyhow::Result<bool> {
        use crate::platform::event_store::{Direction, EventStore, ReadFrom};
        let last = self
            .store
            .read_stream(
                &batch_stream(batch_id),
                Direction::Backwards,
                ReadFrom::End,
                1,
            )
            .await
            .context("reading the batch's last event")?;
        Ok(last
            .first()
            .is_some_and(|event| event.event_type == "CodeBatchRevoked"))
    }

    /// Revoke a batch: its unredeemed codes stop working. Redis is marked first, so that its
    /// cache is never behind the store about a revocation (redemptions trust its "not revoked";
    /// a refusal for "revoked" is confirmed on the store): without Redis, nothing is revoked.
    pub async fn revoke(
        &self,
        batch_id: BatchId,
        reason: String,
        metadata: &EventMetadata,
    ) -> Result<Batch, BatchCommandError> {
        let stream = batch_stream(batch_id);
        let command = BatchCommand::Revoke {
            reason,
            at: self.clock.now(),
        };
        let policy = RetryPolicy::default();
        for attempt in 1..=policy.attempts_max {
            let loaded = command::load::<CodeBatch>(&self.store, &stream).await?;
            let (Some(batch), Some(version)) = (loaded.state.clone(), loaded.version) else {
                return Err(BatchError::NotFound.into());
            };
            if batch.revoked_at.is_none() {
                let mut marked = batch.clone();
                marked.revoked_at = Some(self.clock.now());
                // The version the revocation will have: a loader of the state before it cannot
                // overwrite the mark.
                self.cache(&marked, version + 1)
                    .await
                    .context("marking the batch revoked in Redis")?;
            }
            match command::execute_on::<CodeBatch>(
                &self.store,
                &stream,
                loaded,
                &command,
                metadata,
                RetryPolicy {
                    attempts_max: 1,
                    ..policy
                },
            )
            .await
            {
                Ok(done) => {
                    let batch = done.state.ok_or(BatchError::NotFound)?;
                    if let Err(error) = self.cache_batch(batch_id).await {
                        tracing::warn!(%batch_id, error = %crate::platform::telemetry::error_chain(&error), "could not cache a revoked batch");
                    }
                    return Ok(batch);
                }
                // A page was issued meanwhile: mark again on the new version.
                Err(CommandError::Contended { .. }) if attempt < policy.attempts_max => continue,
                Err(error) => return Err(error.into()),
            }
        }
        Err(BatchCommandError::Contended(stream))
    }

    /// Redeemed codes of a batch, from the read model.
    pub async fn redeemed_count(&self, batch_id: BatchId) -> anyhow::Result<i64> {
        let client = crate::platform::postgres::checkout(&self.pool)
            .await
            .context("getting a connection")?;
        Ok(client
            .query_one(
                "SELECT count(*) FROM redeem_codes WHERE batch_id = $1 AND redeemed_by IS NOT NULL",
                &[&batch_id],
            )
            .await
            .context("counting redeemed codes")?
            .get(0))
    }

    /// Put a batch (latest version) into Redis.
    pub async fn cache_batch(&self, batch_id: BatchId) -> anyhow::Result<Option<Batch>> {
        let Some((batch, version)) = self.batch(batch_id).await? else {
            return Ok(None);
        };
        self.cache(&batch, version).await?;
        Ok(Some(batch))
    }

    async fn cache(&self, batch: &Batch, version: u64) -> anyhow::Result<()> {
        let packed = format!(
            "{} {} {} {} {} {} {} {}",
            batch.first_serial,
            batch.spec.count,
            batch.issued,
            batch.spec.points,
            batch.spec.valid_from.timestamp_millis(),
            batch.spec.valid_until.timestamp_millis(),
            u8::from(batch.revoked_at.is_some()),
            version
        );
        let mut connection = self.redis.connection().await?;
        // Two steps, each safe to repeat (the batch lives under its own tag, the ranges of all
        // batches in another slot): the batch first, so a range never leads to nothing for long
        // (and when it does, the redemption asks the store).
        let _loaded: i64 = crate::points::codes::scripts::CODE_BATCH_LOAD
            .key(self.batch_key(batch.batch_id))
            .arg(packed)
            .arg(version)
            .invoke_async(&mut connection)
            .await
            .context("caching a batch in Redis")?;
        let _: i64 = redis::cmd("ZADD")
            .arg(self.ranges_key())
            .arg(batch.first_serial)
            .arg(batch.batch_id.to_string())
            .query_async(&mut connection)
            .await
            .context("caching a batch's range in Redis")?;
        Ok(())
    }

    /// Every batch's first serial (sorted set: batch id scored by its first serial): which batch
    /// a serial belongs to.
    fn ranges_key(&self) -> String {
        self.redis.key("codes:ranges")
    }

    /// A batch's cached state ("first count issued points from_ms until_ms revoked version"),
    /// under the batch's own tag with its codes' redeemed markers: batches spread over a
    /// cluster's nodes.
    pub fn batch_key(&self, batch_id: BatchId) -> String {
        self.redis
            .tagged(&format!("code-batch:{batch_id}"), "state")
    }

    fn marker_key(&self, batch_id: BatchId, serial: u32) -> String {
        self.redis.tagged(
            &format!("code-batch:{batch_id}"),
            &format!("redeemed:{serial}"),
        )
    }

    fn failures_key(&self, user_id: UserId) -> String {
        self.redis.tagged(
            &crate::platform::redis_store::user_tag(user_id),
            "code-failures",
        )
    }

    /// Issue the next page of a batch (at most `page_size` codes), continuing where the last page
    /// ended. `Ok(None)` when nothing is left to issue (complete, revoked or unknown).
    pub async fn issue_page(
        &self,
        batch_id: BatchId,
        metadata: &EventMetadata,
    ) -> anyhow::Result<Option<Batch>> {
        let stream = batch_stream(batch_id);
        for _ in 0..RetryPolicy::default().attempts_max {
            let loaded = command::load::<CodeBatch>(&self.store, &stream).await?;
            let Some(batch) = loaded.state.clone() else {
                return Ok(None);
            };
            if batch.revoked_at.is_some() || batch.is_complete() {
                return Ok(None);
            }
            let page = BatchCommand::IssuePage {
                from_serial: batch.first_serial + batch.issued,
                page_max: self.settings.page_size,
                at: self.clock.now(),
            };
            match command::execute_on::<CodeBatch>(
                &self.store,
                &stream,
                loaded,
                &page,
                metadata,
                RetryPolicy {
                    attempts_max: 1,
                    ..RetryPolicy::default()
                },
            )
            .await
            {
                Ok(done) => {
                    let batch = done.state.context("an issued batch has state")?;
                    let version = self
                        .batch(batch_id)
                        .await?
                        .map(|(_, version)| version)
                        .unwrap_or_default();
                    if let Err(error) = self.cache(&batch, version).await {
                        tracing::warn!(%batch_id, error = %crate::platform::telemetry::error_chain(&error), "could not cache an issued page");
                    }
                    return Ok(Some(batch));
                }
                // Another generator issued this page first (or revoked it): look again.
                Err(CommandError::Rejected(BatchError::PageOutOfOrder { .. }))
                | Err(CommandError::Contended { .. }) => continue,
                Err(CommandError::Rejected(BatchError::Revoked)) => return Ok(None),
                Err(CommandError::Rejected(error)) => {
                    return Err(anyhow::Error::new(error).context("issuing a page"));
                }
                Err(CommandError::Store(error)) => return Err(error),
            }
        }
        Err(anyhow::Error::new(command::StreamContended {
            stream: batch_stream(batch_id),
            attempts: RetryPolicy::default().attempts_max,
        })
        .context("issuing a page"))
    }

    /// The batch a serial belongs to, from the store: the read model finds it by range, and the
    /// allocator's stream (the truth) when the read model has not seen it yet.
    async fn batch_of_serial(&self, serial: u32) -> anyhow::Result<Option<(Batch, u64)>> {
        let candidate: Option<Uuid> = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query_opt(
                    "SELECT batch_id FROM code_batches WHERE first_serial <= $1
                      ORDER BY first_serial DESC LIMIT 1",
                    &[&i32::try_from(serial)?],
                )
                .await
                .context("finding a serial's batch")?
                .map(|row| row.get(0))
        };
        if let Some(batch_id) = candidate
            && let Some((batch, version)) = self.batch(batch_id).await?
            && batch.contains(serial)
        {
            return Ok(Some((batch, version)));
        }
        let serials = command::load::<SerialAllocator>(&self.store, SERIALS_STREAM).await?;
        let owner = serials
            .state
            .reserved
            .iter()
            .find(|(_, (first, count))| serial >= *first && serial - first < *count)
            .map(|(batch_id, _)| *batch_id);
        match owner {
            Some(batch_id) => self.batch(batch_id).await,
            None => Ok(None),
        }
    }

    // -----------------------------------------------------------------------------------------
    // Redemption.

    /// The codes of a batch as CSV, a page at a time (never the whole batch in memory): the
    /// header, then `serial,code,points,valid_from,valid_until,redeemed_by,redeemed_at` per
    /// issued code.
    pub fn export(
        &self,
        batch: Batch,
    ) -> impl Stream<Item = anyhow::Result<Bytes>> + Send + 'static + use<> {
        /// Codes per chunk: one query and about 1 MB of text per 10,000.
        const EXPORT_PAGE: u32 = 10_000;
        let service = self.clone();
        let header = Bytes::from_static(
            b"serial,code,points,valid_from,valid_until,redeemed_by,redeemed_at\n",
        );
        let first = batch.first_serial;
        let end = batch.first_serial + batch.issued;
        let pages = futures::stream::unfold(first, move |from| {
            let service = service.clone();
            let batch = batch.clone();
            async move {
                if from >= end {
                    return None;
                }
                let to = end.min(from.saturating_add(EXPORT_PAGE));
                Some((service.export_page(&batch, from, to).await, to))
            }
        });
        futures::StreamExt::chain(futures::stream::once(async { Ok(header) }), pages)
    }

    async fn export_page(&self, batch: &Batch, from: u32, to: u32) -> anyhow::Result<Bytes> {
        use std::fmt::Write;
        let redeemed: HashMap<u32, (Uuid, DateTime<Utc>)> = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query(
                    "SELECT serial, redeemed_by, redeemed_at FROM redeem_codes
                      WHERE serial >= $1 AND serial < $2 AND redeemed_by IS NOT NULL",
                    &[&i32::try_from(from)?, &i32::try_from(to)?],
                )
                .await
                .context("reading redeemed codes")?
                .iter()
                .map(|row| {
                    Ok((
                        u32::try_from(row.get::<_, i32>(0))?,
                        (row.get(1), row.get(2)),
                    ))
                })
                .collect::<anyhow::Result<_>>()?
        };
        let valid_from = batch
            .spec
            .valid_from
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let valid_until = batch
            .spec
            .valid_until
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let mut text = String::with_capacity(((to - from) as usize) * 90);
        for serial in from..to {
            let code = self
                .keys
                .encode(batch.key_slot, serial)
                .with_context(|| format!("the key of slot {} is not configured", batch.key_slot))?;
            let (by, at) = match redeemed.get(&serial) {
                Some((by, at)) => (
                    by.to_string(),
                    at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                ),
                None => (String::new(), String::new()),
            };
            writeln!(
                text,
                "{serial},{code},{},{valid_from},{valid_until},{by},{at}",
                batch.spec.points
            )
            .context("formatting a CSV line")?;
        }
        Ok(Bytes::from(text))
    }

    /// A code's life (`zhihui audit code`): its batch, its redemption and its credit, each from
    /// its stream. `None`: `text` is no code of ours (malformed or forged).
    pub async fn life(&self, text: &str) -> anyhow::Result<Option<CodeLife>> {
        let Ok(code) = self.keys.decode(text) else {
            return Ok(None);
        };
        let serial = code.serial();
        let batch = self.batch_of_serial(serial).await?.map(|(batch, _)| batch);
        let mut redemption = command::load::<CodeRedemption>(&self.store, &code_stream(serial))
            .await?
            .state;
        let mut credit = None;
        if redemption.is_none() {
            // Redeemed in one append: the credit stored under the code's id is the redemption.
            let stored = self
                .store
                .event_by_id(credit_event_id(serial))
                .await
                .context("finding the code's credit")?;
            if let Some(stored) = stored {
                let user_id = zhihui_domain::account::user_of_account_stream(&stored.stream)
                    .with_context(|| format!("the code's credit is in {}", stored.stream))?;
                let event = <zhihui_domain::account::AccountEvent as zhihui_domain::DomainEvent>::from_stored(
                    &stored.event_type,
                    stored.schema_version,
                    &stored.payload,
                )
                .context("decoding the code's credit")?;
                if let zhihui_domain::account::AccountEvent::Credited(e) = event {
                    let batch_id = zhihui_domain::redeem::parse_credit_reference(&e.reference)
                        .map(|(batch_id, _)| batch_id)
                        .with_context(|| format!("the code's credit names {:?}", e.reference))?;
                    redemption = Some(CodeRedeemed {
                        serial,
                        batch_id,
                        user_id,
                        points: e.amount,
                        at: e.at,
                    });
                    credit = Some(e);
                }
            }
        } else if let Some(redemption) = &redemption {
            let operation_id = credit_operation_id(serial);
            command::load_inspecting::<Account>(
                &self.store,
                &account_stream(redemption.user_id),
                |event| {
                    if let zhihui_domain::account::AccountEvent::Credited(e) = event
                        && e.operation_id == operation_id
                    {
                        credit = Some(e.clone());
                    }
                },
            )
            .await
            .context("reading the redeemer's account")?;
        }
        Ok(Some(CodeLife {
            code: code.to_string(),
            serial,
            key_slot: code.slot(),
            batch,
            redemption,
            credit,
        }))
    }
}

/// What `zhihui audit code` shows.
#[derive(Debug)]
pub struct CodeLife {
    pub code: String,
    pub serial: u32,
    pub key_slot: u8,
    pub batch: Option<Batch>,
    pub redemption: Option<CodeRedeemed>,
    pub credit: Option<zhihui_domain::account::PointsCredited>,
}
