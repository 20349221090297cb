//! `code_batches` and `redeem_codes` (see `migrations/V7__redeem_codes.sql`): batches with their
//! progress and revocation, one row per issued code with its redemption and its credit. Reads
//! the batch and code events and the `PointsCredited` events (only code credits change a row), by
//! event type: reading every account event for the few credits would double the ledger's reads.
//! A code's credit is its redemption (redeemer, time) when no `CodeRedeemed` came first.
//! Redemptions and credits are written in sets (one statement for each kind per run of them
//! between batch events), not a statement per code: a busy redemption path projects thousands a
//! second.

use anyhow::Context;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountEvent, CreditKind};
use zhihui_domain::redeem::{
    BatchEvent, RedemptionEvent, batch_id_of_stream, parse_credit_reference, serial_of_stream,
};

use crate::accounts::account_user_id;
use crate::{ProjectedEvent, Tables};

/// The event types the projection reads.
pub const EVENT_TYPES: &[&str] = &[
    "CodeBatchCreated",
    "CodesIssued",
    "CodeBatchRevoked",
    "CodeRedeemed",
    "PointsCredited",
];

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let batches = tables.name("code_batches");
    let codes = tables.name("redeem_codes");
    let mut pending = Pending::default();
    for recorded in events {
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        let version = i64::try_from(recorded.stream_version)?;
        if batch_id_of_stream(&recorded.stream).is_some() {
            // Written in the log's order around a batch's own events.
            pending.write(transaction, &codes).await?;
            let event = BatchEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            match event {
                BatchEvent::Created(e) => {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {batches} (batch_id, first_serial, count, points,
                                     valid_from, valid_until, note, key_slot, created_at,
                                     created_by, stream_version)
                                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
                                 ON CONFLICT (batch_id) DO NOTHING"
                            ),
                            &[
                                &e.batch_id,
                                &i32::try_from(e.first_serial)?,
                                &i32::try_from(e.count)?,
                                &e.points.as_decimal(),
                                &e.valid_from,
                                &e.valid_until,
                                &e.note,
                                &i16::from(e.key_slot),
                                &e.at,
                                &recorded.actor,
                                &version,
                            ],
                        )
                        .await
                        .context("inserting a batch")?;
                }
                BatchEvent::Issued(e) => {
                    let updated = transaction
                        .execute(
                            &format!(
                                "UPDATE {batches}
                                    SET issued = $2::integer + $3::integer - first_serial, stream_version = $4
                                  WHERE batch_id = $1 AND stream_version < $4"
                            ),
                            &[
                                &e.batch_id,
                                &i32::try_from(e.from_serial)?,
                                &i32::try_from(e.count)?,
                                &version,
                            ],
                        )
                        .await
                        .context("advancing a batch")?;
                    if updated == 1 {
                        // One set-based statement per page, however large.
                        transaction
                            .execute(
                                &format!(
                                    "INSERT INTO {codes} (serial, batch_id, issued_at)
                                     SELECT serial, $1, $4
                                       FROM generate_series($2::integer, $2::integer + $3::integer - 1) AS serial
                                     ON CONFLICT (serial) DO NOTHING"
                                ),
                                &[
                                    &e.batch_id,
                                    &i32::try_from(e.from_serial)?,
                                    &i32::try_from(e.count)?,
                                    &e.at,
                                ],
                            )
                            .await
                            .context("inserting a page of codes")?;
                    }
                }
                BatchEvent::Revoked(e) => {
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {batches}
                                    SET revoked_at = $2, revoke_reason = $3, stream_version = $4
                                  WHERE batch_id = $1 AND stream_version < $4"
                            ),
                            &[&e.batch_id, &e.at, &e.reason, &version],
                        )
                        .await
                        .context("revoking a batch")?;
                }
            }
        } else if serial_of_stream(&recorded.stream).is_some() {
            let RedemptionEvent::Redeemed(e) = RedemptionEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            pending.redeemed(&e)?;
        } else if let Some(user_id) = account_user_id(&recorded.stream) {
            let AccountEvent::Credited(e) = AccountEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?
            else {
                continue;
            };
            if e.kind != CreditKind::RedeemCode {
                continue;
            }
            let Some((batch_id, serial)) = parse_credit_reference(&e.reference) else {
                continue;
            };
            // The credit is the redemption (one append) or follows it (a code's own stream, from
            // before that or on KurrentDB): the first to name a redeemer sets it.
            pending.redeemed(&zhihui_domain::redeem::CodeRedeemed {
                serial,
                batch_id,
                user_id: zhihui_domain::user::UserId::from_uuid(user_id),
                points: e.amount,
                at: e.at,
            })?;
            pending.credited(serial, user_id, e.at)?;
        }
    }
    pending.write(transaction, &codes).await?;
    Ok(())
}

/// Redemptions and credits read since the last write, in the log's order.
#[derive(Default)]
struct Pending {
    redeemed_serials: Vec<i32>,
    redeemed_batches: Vec<uuid::Uuid>,
    redeemed_by: Vec<uuid::Uuid>,
    redeemed_at: Vec<chrono::DateTime<chrono::Utc>>,
    credited_serials: Vec<i32>,
    credited_users: Vec<uuid::Uuid>,
    credited_at: Vec<chrono::DateTime<chrono::Utc>>,
    /// What is already in this set: one statement may change a row only once, and the first
    /// of two is the one a statement per event would have kept.
    seen_redeemed: std::collections::HashSet<i32>,
    seen_credited: std::collections::HashSet<(i32, uuid::Uuid)>,
}

impl Pending {
    fn redeemed(&mut self, e: &zhihui_domain::redeem::CodeRedeemed) -> anyhow::Result<()> {
        let serial = i32::try_from(e.serial)?;
        if self.seen_redeemed.insert(serial) {
            self.redeemed_serials.push(serial);
            self.redeemed_batches.push(e.batch_id);
            self.redeemed_by.push(e.user_id.as_uuid());
            self.redeemed_at.push(e.at);
        }
        Ok(())
    }

    fn credited(
        &mut self,
        serial: u32,
        user_id: uuid::Uuid,
        at: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<()> {
        let serial = i32::try_from(serial)?;
        if self.seen_credited.insert((serial, user_id)) {
            self.credited_serials.push(serial);
            self.credited_users.push(user_id);
            self.credited_at.push(at);
        }
        Ok(())
    }

    /// Write the redemptions, then the credits (a code's credit always follows its redemption
    /// in the log), and start again empty.
    async fn write(
        &mut self,
        transaction: &tokio_postgres::Transaction<'_>,
        codes: &str,
    ) -> anyhow::Result<()> {
        if !self.redeemed_serials.is_empty() {
            // A code is redeemed only once issued, so its row exists; the upsert keeps the
            // projection total anyway.
            transaction
                .execute(
                    &format!(
                        "INSERT INTO {codes} (serial, batch_id, issued_at, redeemed_by, redeemed_at)
                         SELECT x.serial, x.batch_id, x.at, x.user_id, x.at
                           FROM unnest($1::integer[], $2::uuid[], $3::uuid[], $4::timestamptz[])
                                AS x(serial, batch_id, user_id, at)
                         ON CONFLICT (serial) DO UPDATE
                            SET redeemed_by = EXCLUDED.redeemed_by, redeemed_at = EXCLUDED.redeemed_at
                          WHERE {codes}.redeemed_by IS NULL"
                    ),
                    &[
                        &self.redeemed_serials,
                        &self.redeemed_batches,
                        &self.redeemed_by,
                        &self.redeemed_at,
                    ],
                )
                .await
                .context("recording redemptions")?;
        }
        if !self.credited_serials.is_empty() {
            // Only the redeemer's credit marks the row: a credit on another account would be a
            // difference for `audit verify`, not a credit of this redemption.
            transaction
                .execute(
                    &format!(
                        "UPDATE {codes} AS c SET credited_at = x.at
                           FROM unnest($1::integer[], $2::uuid[], $3::timestamptz[])
                                AS x(serial, user_id, at)
                          WHERE c.serial = x.serial AND c.redeemed_by = x.user_id
                            AND c.credited_at IS NULL"
                    ),
                    &[
                        &self.credited_serials,
                        &self.credited_users,
                        &self.credited_at,
                    ],
                )
                .await
                .context("marking codes credited")?;
        }
        *self = Pending::default();
        Ok(())
    }
}
