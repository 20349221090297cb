//! The claims' consumer: what the gate let through is persisted from the `promo:claims` Redis
//! stream by a consumer group (`XREADGROUP`; `XAUTOCLAIM` takes over a dead consumer's pending
//! entries), each entry made durable idempotently (reserve, charge, grant or refuse, credit)
//! before its `XACK`; entries that keep failing are parked, and `repair_once` finishes what an
//! entry lost midway left owed.

use super::*;

impl PromotionService {
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
            Ok(handled) => {
                if let Some(PromotionEvent::TurnedAway(turned)) = handled.new_events.first() {
                    self.turned_away_at_gate(entry, &turned.reason).await;
                    let outcome = Outcome::Refused(turned.reason.clone());
                    self.tell(entry, &outcome).await;
                    return Ok(outcome);
                }
                handled.state_after.context("a reserved promotion")?
            }
            Err(CommandError::Rejected(error)) => {
                let reason = match error {
                    PromotionError::AlreadyClaimed => "already-claimed",
                    PromotionError::Unknown => "unknown-promotion",
                    // Refused or turned away before (a repeat of this claim).
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

    /// The gate after the store turned a claim away: its user may claim again; the unit goes
    /// back when the promotion was not open (it was never the store's to take), not when the
    /// store had none left (the gate counted one too many: keeping it taken brings the gate back
    /// to the store). Redis is a cache: a failure here is corrected by the next load.
    async fn turned_away_at_gate(&self, entry: &ClaimEntry, reason: &str) {
        let operation = if reason == "sold-out" {
            "forget"
        } else {
            "release"
        };
        if let Err(error) = self
            .adjust(entry.promotion_id, operation, &entry.user_id.to_string())
            .await
        {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "a turned-away claim's user not released at the gate");
        }
    }

    /// Charge the price (if any); grant, or refuse when it cannot be paid (and give the unit
    /// back to the gate).
    pub(super) async fn pay_and_grant(
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

    pub(super) async fn credit(
        &self,
        entry: &ClaimEntry,
        state: &PromotionState,
    ) -> anyhow::Result<()> {
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

    pub(super) async fn tell(&self, entry: &ClaimEntry, outcome: &Outcome) {
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

    pub(super) async fn ensure_group(
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

    pub(super) async fn handle(
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
    pub(super) async fn park(
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
