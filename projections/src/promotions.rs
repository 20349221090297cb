//! `promotions` and `promotion_claims` (see `migrations/V9__promotions.sql`): each promotion with
//! its stock, units taken and granted; each persisted claim with its status and its credit. Reads
//! the promotion events and the `PointsCredited` events (only claim credits change a row), by
//! event type.

use anyhow::Context;
use rust_decimal::Decimal;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountEvent, CreditKind};
use zhihui_domain::promotion::{PromotionEvent, parse_claim_reference, promotion_of_stream};

use crate::accounts::account_user_id;
use crate::{ProjectedEvent, Tables};

/// The event types the projection reads.
pub fn event_types() -> Vec<String> {
    zhihui_domain::promotion::EVENT_TYPES
        .iter()
        .chain(&["PointsCredited"])
        .map(|t| (*t).to_owned())
        .collect()
}

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let promotions = tables.name("promotions");
    let claims = tables.name("promotion_claims");
    for recorded in events {
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        let version = i64::try_from(recorded.stream_version)?;
        if let Some(promotion_id) = promotion_of_stream(&recorded.stream) {
            let event = PromotionEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            // Every event moves the row's version; each statement applies once (version guard).
            let advance = |set: &str| {
                format!(
                    "UPDATE {promotions} SET {set}, stream_version = $2
                      WHERE promotion_id = $1 AND stream_version < $2"
                )
            };
            let applied = match &event {
                PromotionEvent::Created(e) => transaction
                    .execute(
                        &format!(
                            "INSERT INTO {promotions} (promotion_id, title, points, price, stock,
                                     starts_at, ends_at, created_at, stream_version)
                                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                                 ON CONFLICT (promotion_id) DO NOTHING"
                        ),
                        &[
                            &promotion_id,
                            &e.spec.title,
                            &e.spec.points.as_decimal(),
                            &e.spec.price.map_or(Decimal::ZERO, |p| p.as_decimal()),
                            &i32::try_from(e.spec.stock)?,
                            &e.spec.starts_at,
                            &e.spec.ends_at,
                            &e.at,
                            &version,
                        ],
                    )
                    .await
                    .context("inserting a promotion")?,
                PromotionEvent::Ended(e) => transaction
                    .execute(&advance("ended_at = $3"), &[&promotion_id, &version, &e.at])
                    .await
                    .context("ending a promotion")?,
                PromotionEvent::StockRaised(e) => transaction
                    .execute(
                        &advance("stock = $3"),
                        &[&promotion_id, &version, &i32::try_from(e.stock_after)?],
                    )
                    .await
                    .context("raising a stock")?,
                PromotionEvent::Reserved(_) => transaction
                    .execute(&advance("taken = taken + 1"), &[&promotion_id, &version])
                    .await
                    .context("counting a reservation")?,
                PromotionEvent::Granted(_) => transaction
                    .execute(
                        &advance("granted = granted + 1"),
                        &[&promotion_id, &version],
                    )
                    .await
                    .context("counting a grant")?,
                PromotionEvent::Refused(_) => transaction
                    .execute(&advance("taken = taken - 1"), &[&promotion_id, &version])
                    .await
                    .context("counting a refusal")?,
                // It took no unit: only the version moves.
                PromotionEvent::TurnedAway(_) => transaction
                    .execute(&advance("taken = taken"), &[&promotion_id, &version])
                    .await
                    .context("recording a claim turned away")?,
            };
            if applied == 0 {
                continue;
            }
            match event {
                PromotionEvent::Reserved(e) => {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {claims} (claim_id, promotion_id, user_id, status, accepted_at)
                                 VALUES ($1, $2, $3, 'reserved', $4)
                                 ON CONFLICT (claim_id) DO NOTHING"
                            ),
                            &[&e.claim_id, &promotion_id, &e.user_id.as_uuid(), &e.accepted_at],
                        )
                        .await
                        .context("recording a claim")?;
                }
                PromotionEvent::Granted(e) => {
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {claims} SET status = 'granted', decided_at = $2
                                  WHERE claim_id = $1 AND status = 'reserved'"
                            ),
                            &[&e.claim_id, &e.at],
                        )
                        .await
                        .context("granting a claim")?;
                }
                PromotionEvent::Refused(e) => {
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {claims} SET status = 'refused', reason = $3, decided_at = $2
                                  WHERE claim_id = $1 AND status = 'reserved'"
                            ),
                            &[&e.claim_id, &e.at, &e.reason],
                        )
                        .await
                        .context("refusing a claim")?;
                }
                PromotionEvent::TurnedAway(e) => {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {claims} (claim_id, promotion_id, user_id, status, reason, accepted_at, decided_at)
                                 VALUES ($1, $2, $3, 'refused', $4, $5, $6)
                                 ON CONFLICT (claim_id) DO NOTHING"
                            ),
                            &[&e.claim_id, &promotion_id, &e.user_id.as_uuid(), &e.reason, &e.accepted_at, &e.at],
                        )
                        .await
                        .context("recording a claim turned away")?;
                }
                _ => {}
            }
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
            if e.kind != CreditKind::Promotion {
                continue;
            }
            let Some((_promotion, claim_id)) = parse_claim_reference(&e.reference) else {
                continue;
            };
            transaction
                .execute(
                    &format!(
                        "UPDATE {claims} SET credited_at = $3
                          WHERE claim_id = $1 AND user_id = $2 AND credited_at IS NULL"
                    ),
                    &[&claim_id, &user_id, &e.at],
                )
                .await
                .context("marking a claim credited")?;
        }
    }
    Ok(())
}
