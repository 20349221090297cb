//! Redemption: a code is parsed and its signature checked offline (a forged code costs no
//! lookup, and a user sending many is slowed), then the Redis fast path (`lua/code_redeem.lua`)
//! tells a used or revoked code at once, and the store decides: one credit per code, held by its
//! event id (or by the code's own stream where ids are unique per stream only).
//! `repair_credits_once` credits what a crash left unpaid between a code's stream and its credit.

use super::*;

#[derive(Debug, Clone, Copy)]
pub(super) struct Forged {
    pub(super) started: DateTime<Utc>,
    pub(super) count: u32,
    pub(super) unshared: u32,
}

/// What the Lua step answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum FastPath {
    Limited {
        retry_after_ms: i64,
    },
    Miss,
    Revoked {
        batch_id: BatchId,
    },
    Window {
        from_ms: i64,
        until_ms: i64,
    },
    /// Passed: the marker was set now (`first`), was already ours (`mine`) or another user's.
    Passed {
        batch_id: BatchId,
        marker: Marker,
        /// The batch's points per code.
        points: zhihui_domain::points::Amount,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Marker {
    First,
    Mine,
    Taken,
}

impl CodeService {
    /// Redeem `text` for `user_id` (see the module comment).
    pub async fn redeem(
        &self,
        user_id: UserId,
        text: &str,
        metadata: &EventMetadata,
    ) -> Result<Redemption, RedeemError> {
        let now = self.clock.now();
        if let Some(retry_at) = self.forged_limited(user_id, now) {
            return Err(RedeemError::Limited { retry_at });
        }
        let Ok(code) = self.keys.decode(text) else {
            self.count_forged(user_id, now);
            return Err(RedeemError::Invalid);
        };
        let outcome = self
            .redeem_serial(user_id, code.serial(), now, metadata)
            .await;
        if let Err(error) = &outcome
            && error.counts()
            && let Err(count_error) = self.count_failure(user_id).await
        {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&count_error), "could not count a failed redemption");
        }
        outcome
    }

    pub(super) async fn redeem_serial(
        &self,
        user_id: UserId,
        serial: u32,
        now: DateTime<Utc>,
        metadata: &EventMetadata,
    ) -> Result<Redemption, RedeemError> {
        // The batch as the store has it, once this request had to read it.
        let mut from_store: Option<Batch> = None;
        let mut fast = self.fast_path(user_id, serial, now).await;
        if matches!(fast, Ok(FastPath::Miss) | Err(_)) {
            if let Err(error) = &fast {
                // Redis is a cache: without it, the store decides alone.
                tracing::warn!(error = %crate::platform::telemetry::error_chain(error), "redeem fast path failed; deciding from the store");
            }
            let Some((batch, version)) = self.batch_of_serial(serial).await? else {
                return Err(RedeemError::Unknown);
            };
            if !batch.has_issued(serial) {
                return Err(RedeemError::Unknown);
            }
            if fast.is_ok() {
                match self.cache(&batch, version).await {
                    Ok(()) => fast = self.fast_path(user_id, serial, now).await,
                    Err(error) => fast = Err(error),
                }
            }
            from_store = Some(batch);
        }
        if let Ok(FastPath::Revoked { batch_id }) = fast {
            // A refusal stands only on the batch's latest version (the cache is marked revoked
            // before the revocation is appended; an append that then failed left it wrong).
            let (batch, version) = self.batch(batch_id).await?.ok_or(RedeemError::Unknown)?;
            if batch.revoked_at.is_some() {
                return Err(RedeemError::Revoked);
            }
            if let Err(error) = self.cache(&batch, version).await {
                tracing::warn!(%batch_id, error = %crate::platform::telemetry::error_chain(&error), "could not correct a cached revocation");
            }
            from_store = Some(batch);
            fast = Ok(FastPath::Miss);
        }
        let (batch_id, marker, points) = match fast {
            Ok(FastPath::Limited { retry_after_ms }) => {
                return Err(RedeemError::Limited {
                    retry_at: now + chrono::Duration::milliseconds(retry_after_ms.max(1)),
                });
            }
            Ok(FastPath::Window { from_ms, until_ms }) => {
                // The window never changes: the cached one is the batch's.
                return Err(RedeemError::NotValidNow {
                    valid_from: crate::platform::clock::from_unix_ms(from_ms),
                    valid_until: crate::platform::clock::from_unix_ms(until_ms),
                });
            }
            // Revocations are in the cache before they are in the store (see `revoke`), but a
            // Redis that fails over to a replica, or restarts losing its last second, can undo
            // that mark: the batch's last event decides (a revocation is a batch's last event).
            // The points never change: the cached ones are the batch's.
            Ok(FastPath::Passed {
                batch_id,
                marker,
                points,
            }) => {
                if from_store.is_none() && self.revoked_in_store(batch_id).await? {
                    if let Err(error) = self.cache_batch(batch_id).await {
                        tracing::warn!(%batch_id, error = %crate::platform::telemetry::error_chain(&error), "could not correct a cached batch that lost its revocation");
                    }
                    return Err(RedeemError::Revoked);
                }
                (batch_id, marker, points)
            }
            // Flushed again in between, Redis down, or a stale revocation: the batch as the
            // store has it.
            Ok(FastPath::Miss | FastPath::Revoked { .. }) | Err(_) => {
                let batch = from_store.as_ref().ok_or(RedeemError::Unknown)?;
                if batch.revoked_at.is_some() {
                    return Err(RedeemError::Revoked);
                }
                if !batch.spec.valid_at(now) {
                    return Err(RedeemError::NotValidNow {
                        valid_from: batch.spec.valid_from,
                        valid_until: batch.spec.valid_until,
                    });
                }
                (batch.batch_id, Marker::Taken, batch.spec.points)
            }
        };
        if self.store.event_ids_unique_across_streams() {
            return self
                .redeem_in_one_append(user_id, serial, batch_id, points, now, metadata)
                .await;
        }
        self.redeem_in_two_appends(user_id, serial, batch_id, points, marker, now, metadata)
            .await
    }

    /// The redemption is the credit: one append to the redeemer's account, under the event id
    /// derived from the code (`credit_event_id`), which the store holds once across the log. A
    /// second account's credit of the code is the store's "id reused" answer; the same
    /// account's is a repeat of its operation.
    async fn redeem_in_one_append(
        &self,
        user_id: UserId,
        serial: u32,
        batch_id: BatchId,
        points: zhihui_domain::points::Amount,
        now: DateTime<Utc>,
        metadata: &EventMetadata,
    ) -> Result<Redemption, RedeemError> {
        let mut redeemed_before = false;
        let mut at = now;
        // A code redeemed before redemptions took one append holds its redeemer in its own
        // stream (and its credit carries no derived id): that stream still decides it.
        if self.legacy_redemptions_exist().await? {
            let loaded = command::load::<CodeRedemption>(&self.store, &code_stream(serial))
                .await
                .context("reading a code's stream")?;
            if let Some(redeemed) = loaded.state {
                if redeemed.user_id != user_id {
                    return Err(RedeemError::RedeemedByAnother);
                }
                // Ours: a repeat, or the credit a crash left unpaid.
                redeemed_before = true;
                at = redeemed.at;
            }
        }
        let credited = self
            .accounts
            .execute(
                &account_stream(user_id),
                AccountCommand::Credit {
                    operation_id: credit_operation_id(serial),
                    kind: CreditKind::RedeemCode,
                    amount: points,
                    reference: credit_reference(batch_id, serial),
                    at,
                },
                metadata.clone(),
            )
            .await;
        match credited {
            Ok(handled) => Ok(Redemption {
                serial,
                batch_id,
                points,
                redeemed_now: !redeemed_before && !handled.new_events.is_empty(),
                account: handled.state_after,
            }),
            Err(CommandError::Store(error))
                if error.chain().any(|cause| {
                    matches!(
                        cause.downcast_ref::<EventStoreError>(),
                        Some(EventStoreError::EventIdReused { .. })
                    )
                }) =>
            {
                Err(RedeemError::RedeemedByAnother)
            }
            Err(CommandError::Contended { .. }) => Err(RedeemError::Contended),
            Err(error) => Err(RedeemError::Store(
                error.into_anyhow(format!("crediting code {serial}")),
            )),
        }
    }

    /// Whether this store holds redemptions in codes' own streams: always on KurrentDB; on
    /// PostgreSQL those recorded before redemptions took one append. Asked once per process: no
    /// process of this version writes one on PostgreSQL (processes of the earlier version must
    /// be stopped before this one redeems: they would credit a code without its derived id).
    pub(super) async fn legacy_redemptions_exist(&self) -> anyhow::Result<bool> {
        if !self.store.event_ids_unique_across_streams() {
            return Ok(true);
        }
        self.legacy_redemptions
            .get_or_try_init(|| async {
                let client = crate::platform::postgres::checkout(&self.pool)
                    .await
                    .context("getting a connection")?;
                let row = client
                    .query_one(
                        "SELECT EXISTS (SELECT 1 FROM events WHERE event_type = 'CodeRedeemed')",
                        &[],
                    )
                    .await
                    .context("looking for redemptions in codes' own streams")?;
                anyhow::Ok(row.get::<_, bool>(0))
            })
            .await
            .copied()
    }

    /// Where event ids are unique per stream only (KurrentDB): the code's own stream decides
    /// who redeemed it (the first append, expected version "no stream", wins), then the
    /// redeemer's account is credited; a crash between the two is repaired by the user's retry
    /// or `repair_credits_once`.
    #[allow(clippy::too_many_arguments)]
    async fn redeem_in_two_appends(
        &self,
        user_id: UserId,
        serial: u32,
        batch_id: BatchId,
        points: zhihui_domain::points::Amount,
        marker: Marker,
        now: DateTime<Utc>,
        metadata: &EventMetadata,
    ) -> Result<Redemption, RedeemError> {
        let command = RedemptionCommand::Redeem {
            serial,
            batch_id,
            user_id,
            points,
            at: now,
        };
        let stream = code_stream(serial);
        let redeemed = match marker {
            // Nobody passed the gate before us: append without reading (one round trip).
            Marker::First => {
                command::execute_on::<CodeRedemption>(
                    &self.store,
                    &stream,
                    command::unwritten::<CodeRedemption>(),
                    &command,
                    metadata,
                    RetryPolicy::default(),
                )
                .await
            }
            // The stream decides, whatever the marker says (its holder may have died before
            // appending).
            Marker::Mine | Marker::Taken => {
                command::execute::<CodeRedemption>(
                    &self.store,
                    &stream,
                    &command,
                    metadata,
                    RetryPolicy::default(),
                )
                .await
            }
        };
        let (redemption, redeemed_now) = match redeemed {
            Ok(done) => {
                let redeemed_now = !done.new_events.is_empty();
                (
                    done.state.context("a redeemed code has state")?,
                    redeemed_now,
                )
            }
            Err(CommandError::Rejected(RedemptionError::RedeemedByAnother { .. })) => {
                return Err(RedeemError::RedeemedByAnother);
            }
            Err(CommandError::Contended { .. }) => return Err(RedeemError::Contended),
            Err(CommandError::Store(error)) => return Err(RedeemError::Store(error)),
        };
        let account = self.credit(&redemption, metadata).await?;
        Ok(Redemption {
            serial,
            batch_id,
            points: redemption.points,
            redeemed_now,
            account,
        })
    }

    /// Credit a redemption to its redeemer (idempotent by the serial's operation id).
    /// Returns the account state and whether this call credited it.
    pub(super) async fn credit_reporting(
        &self,
        redemption: &CodeRedeemed,
        metadata: &EventMetadata,
    ) -> anyhow::Result<(AccountState, bool)> {
        let handled = self
            .accounts
            .execute(
                &account_stream(redemption.user_id),
                AccountCommand::Credit {
                    operation_id: credit_operation_id(redemption.serial),
                    kind: CreditKind::RedeemCode,
                    amount: redemption.points,
                    reference: credit_reference(redemption.batch_id, redemption.serial),
                    at: redemption.at,
                },
                metadata.clone(),
            )
            .await
            .map_err(|error| error.into_anyhow(format!("crediting code {}", redemption.serial)))?;
        Ok((handled.state_after, !handled.new_events.is_empty()))
    }

    pub(super) async fn credit(
        &self,
        redemption: &CodeRedeemed,
        metadata: &EventMetadata,
    ) -> anyhow::Result<AccountState> {
        Ok(self.credit_reporting(redemption, metadata).await?.0)
    }

    pub(super) async fn fast_path(
        &self,
        user_id: UserId,
        serial: u32,
        now: DateTime<Utc>,
    ) -> anyhow::Result<FastPath> {
        let mut connection = self.redis.connection().await?;
        let forged = self.take_unshared_forged(user_id);
        // The user's failure limit and which batch the serial is in, at once (each in its own
        // slot of a cluster); then the batch's step, under the batch's tag.
        let mut limit_connection = connection.clone();
        let mut limit = crate::points::codes::scripts::CODE_LIMIT.key(self.failures_key(user_id));
        limit
            .arg(now.timestamp_millis())
            .arg(self.settings.failures_max)
            .arg(forged)
            .arg(self.settings.failures_window_ms);
        let limit = limit.invoke_async::<Vec<String>>(&mut limit_connection);
        let mut range_connection = connection.clone();
        let mut find = redis::cmd("ZREVRANGEBYSCORE");
        find.arg(self.ranges_key())
            .arg(serial)
            .arg("-inf")
            .arg("LIMIT")
            .arg(0)
            .arg(1);
        let range = find.query_async::<Vec<String>>(&mut range_connection);
        let (limit, range) = tokio::join!(limit, range);
        let limit = limit.context("running the redemption limit script")?;
        if limit.first().map(String::as_str) == Some("limited") {
            let retry_after_ms = limit
                .get(1)
                .and_then(|ms| ms.parse().ok())
                .with_context(|| format!("the limit script answered {limit:?}"))?;
            return Ok(FastPath::Limited { retry_after_ms });
        }
        let Some(batch_id) = range
            .context("finding a serial's batch")?
            .into_iter()
            .next()
        else {
            return Ok(FastPath::Miss);
        };
        let batch_id: BatchId = Uuid::parse_str(&batch_id).context("a batch id in the ranges")?;
        let answer: Vec<String> = crate::points::codes::scripts::CODE_REDEEM
            .key(self.batch_key(batch_id))
            .key(self.marker_key(batch_id, serial))
            .arg(serial)
            .arg(user_id.to_string())
            .arg(now.timestamp_millis())
            .arg(self.settings.redis_keep_after_window_ms)
            .arg(batch_id.to_string())
            .invoke_async(&mut connection)
            .await
            .context("running the redeem script")?;
        let field = |index: usize| {
            answer
                .get(index)
                .with_context(|| format!("the redeem script answered {answer:?}"))
        };
        let number = |index: usize| -> anyhow::Result<i64> {
            field(index)?
                .parse()
                .context("a number from the redeem script")
        };
        let batch = |index: usize| -> anyhow::Result<BatchId> {
            Uuid::parse_str(field(index)?).context("a batch id from the redeem script")
        };
        let points = || -> anyhow::Result<zhihui_domain::points::Amount> {
            let decimal: rust_decimal::Decimal =
                field(2)?.parse().context("points from the redeem script")?;
            zhihui_domain::points::Amount::parse(decimal)
                .map_err(|error| anyhow::anyhow!("points from the redeem script: {error}"))
        };
        Ok(match field(0)?.as_str() {
            "limited" => FastPath::Limited {
                retry_after_ms: number(1)?,
            },
            "miss" => FastPath::Miss,
            "revoked" => FastPath::Revoked {
                batch_id: batch(1)?,
            },
            "window" => FastPath::Window {
                from_ms: number(2)?,
                until_ms: number(3)?,
            },
            "first" => FastPath::Passed {
                batch_id: batch(1)?,
                marker: Marker::First,
                points: points()?,
            },
            "mine" => FastPath::Passed {
                batch_id: batch(1)?,
                marker: Marker::Mine,
                points: points()?,
            },
            "taken" => FastPath::Passed {
                batch_id: batch(1)?,
                marker: Marker::Taken,
                points: points()?,
            },
            other => anyhow::bail!("the redeem script answered {other:?}"),
        })
    }

    pub(super) async fn count_failure(&self, user_id: UserId) -> anyhow::Result<()> {
        let mut connection = self.redis.connection().await?;
        let _failures: i64 = crate::points::codes::scripts::CODE_FAILURE
            .key(self.failures_key(user_id))
            .arg(self.clock.now_ms())
            .arg(self.settings.failures_window_ms)
            .invoke_async(&mut connection)
            .await
            .context("counting a failed redemption")?;
        Ok(())
    }

    pub(super) fn window(&self) -> chrono::Duration {
        chrono::Duration::milliseconds(
            i64::try_from(self.settings.failures_window_ms).unwrap_or(i64::MAX),
        )
    }

    /// When this user's forged attempts in this process reached the limit: the end of the window.
    pub(super) fn forged_limited(
        &self,
        user_id: UserId,
        now: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let forged = self.forged.lock().unwrap_or_else(|p| p.into_inner());
        let entry = forged.get(&user_id)?;
        let ends = entry.started + self.window();
        (now < ends && entry.count >= self.settings.failures_max).then_some(ends)
    }

    /// Forged attempts not yet added to the user's counter in Redis: the next lookup adds them,
    /// so guesses count everywhere once the user makes a real attempt, at no extra round trip.
    pub(super) fn take_unshared_forged(&self, user_id: UserId) -> u32 {
        let mut forged = self.forged.lock().unwrap_or_else(|p| p.into_inner());
        forged
            .get_mut(&user_id)
            .map(|entry| std::mem::take(&mut entry.unshared))
            .unwrap_or(0)
    }

    pub(super) fn count_forged(&self, user_id: UserId, now: DateTime<Utc>) {
        let window = self.window();
        let mut forged = self.forged.lock().unwrap_or_else(|p| p.into_inner());
        if forged.len() >= FORGED_USERS_MAX {
            forged.retain(|_, entry| now < entry.started + window);
        }
        if forged.len() >= FORGED_USERS_MAX {
            // Still full of live windows: forget the oldest to stay bounded.
            if let Some(oldest) = forged
                .iter()
                .min_by_key(|(_, entry)| entry.started)
                .map(|(user, _)| *user)
            {
                forged.remove(&oldest);
            }
        }
        let entry = forged.entry(user_id).or_insert(Forged {
            started: now,
            count: 0,
            unshared: 0,
        });
        if now >= entry.started + window {
            *entry = Forged {
                started: now,
                count: 0,
                unshared: 0,
            };
        }
        entry.count += 1;
        entry.unshared += 1;
    }

    // -----------------------------------------------------------------------------------------
    // Repairs, export, inspection.

    /// Credit every code redeemed more than `after` ago whose credit the `codes` read model has
    /// not seen (the request died between the code's stream and the account). Returns the
    /// repairs made (serial, user, redeemed at).
    pub async fn repair_credits_once(
        &self,
        after: chrono::Duration,
        limit: i64,
        metadata: &EventMetadata,
    ) -> anyhow::Result<Vec<(u32, Uuid, DateTime<Utc>)>> {
        let cutoff = self.clock.now() - after;
        let rows = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query(
                    "SELECT serial FROM redeem_codes
                      WHERE redeemed_by IS NOT NULL AND credited_at IS NULL AND redeemed_at <= $1
                      ORDER BY redeemed_at LIMIT $2",
                    &[&cutoff, &limit],
                )
                .await
                .context("reading uncredited codes")?
        };
        let mut repairs = Vec::new();
        for row in rows {
            let serial = u32::try_from(row.get::<_, i32>(0))?;
            let loaded = command::load::<CodeRedemption>(&self.store, &code_stream(serial)).await?;
            let Some(redemption) = loaded.state else {
                continue;
            };
            let (_, credited_now) = self.credit_reporting(&redemption, metadata).await?;
            if credited_now {
                repairs.push((serial, redemption.user_id.as_uuid(), redemption.at));
            }
        }
        Ok(repairs)
    }
}
