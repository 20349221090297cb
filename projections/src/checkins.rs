//! `checkins` (see `migrations/V8__checkins.sql`): one row per user and day checked in, with its
//! streak and bonus, then the bonus's credit. Reads the `CheckedIn` events and the
//! `PointsCredited` events (only bonus credits change a row), by event type.

use anyhow::Context;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountEvent, CreditKind};
use zhihui_domain::checkin::{CheckInEvent, parse_bonus_reference, user_of_checkin_stream};

use crate::accounts::account_user_id;
use crate::{ProjectedEvent, Tables};

/// The event types the projection reads.
pub const EVENT_TYPES: &[&str] = &["CheckedIn", "PointsCredited"];

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let checkins = tables.name("checkins");
    for recorded in events {
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        if user_of_checkin_stream(&recorded.stream).is_some() {
            let CheckInEvent::CheckedIn(e) = CheckInEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            transaction
                .execute(
                    &format!(
                        "INSERT INTO {checkins} (user_id, day, streak, bonus, checked_in_at)
                         VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT (user_id, day) DO NOTHING"
                    ),
                    &[
                        &e.user_id.as_uuid(),
                        &e.day,
                        &i32::try_from(e.streak)?,
                        &e.bonus.as_decimal(),
                        &e.at,
                    ],
                )
                .await
                .context("recording a check-in")?;
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
            if e.kind != CreditKind::CheckInBonus {
                continue;
            }
            let Some(day) = parse_bonus_reference(&e.reference) else {
                continue;
            };
            transaction
                .execute(
                    &format!(
                        "UPDATE {checkins} SET credited_at = $3
                          WHERE user_id = $1 AND day = $2 AND credited_at IS NULL"
                    ),
                    &[&user_id, &day, &e.at],
                )
                .await
                .context("marking a bonus credited")?;
        }
    }
    Ok(())
}
