//! `code_batches` and `redeem_codes` (see `migrations/V7__redeem_codes.sql`): batches with their
//! progress and revocation, one row per issued code with its redemption and its credit. Reads
//! the batch and code events and the `PointsCredited` events (only code credits change a row), by
//! event type: reading every account event for the few credits would double the ledger's reads.

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
    for recorded in events {
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        let version = i64::try_from(recorded.stream_version)?;
        if batch_id_of_stream(&recorded.stream).is_some() {
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
            // A code is redeemed only once issued, so its row exists; the upsert keeps the
            // projection total anyway.
            transaction
                .execute(
                    &format!(
                        "INSERT INTO {codes} (serial, batch_id, issued_at, redeemed_by, redeemed_at)
                         VALUES ($1, $2, $4, $3, $4)
                         ON CONFLICT (serial) DO UPDATE
                            SET redeemed_by = EXCLUDED.redeemed_by, redeemed_at = EXCLUDED.redeemed_at
                          WHERE {codes}.redeemed_by IS NULL"
                    ),
                    &[
                        &i32::try_from(e.serial)?,
                        &e.batch_id,
                        &e.user_id.as_uuid(),
                        &e.at,
                    ],
                )
                .await
                .context("recording a redemption")?;
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
            let Some((_batch, serial)) = parse_credit_reference(&e.reference) else {
                continue;
            };
            // Only the redeemer's credit marks the row: a credit on another account would be a
            // difference for `audit verify`, not a credit of this redemption.
            transaction
                .execute(
                    &format!(
                        "UPDATE {codes} SET credited_at = $3
                          WHERE serial = $1 AND redeemed_by = $2 AND credited_at IS NULL"
                    ),
                    &[&i32::try_from(serial)?, &user_id, &e.at],
                )
                .await
                .context("marking a code credited")?;
        }
    }
    Ok(())
}
