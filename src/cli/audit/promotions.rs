//! The promotion half of `audit verify`: every promotion's claims against its stock and its
//! users, every claim's credit and charge, and the `promotions` / `promotion_claims` read models
//! against the events.
//!
//! What is checked:
//! - never more units taken than the stock (at every reservation), never a user holding two live
//!   claims of one promotion;
//! - every granted claim credited exactly once, to its claimer, for the promotion's points, and
//!   (when it has a price) charged exactly once for it; a claim not granted is never credited,
//!   a refused one never charged; a credit or charge naming no claim is a difference; a granted
//!   claim not credited within the settlement bound is a difference, sooner it is pending;
//! - the read models show what the events say.
//!
//! Credits are inflow and charges revenue in the conservation check (`PointsCredited`,
//! `PointsCharged`).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use uuid::Uuid;
use zhihui_domain::account::{AccountEvent, CreditKind};
use zhihui_domain::promotion::{
    ClaimId, ClaimStatus, Promotion, PromotionEvent, PromotionId, PromotionState,
    parse_claim_reference,
};
use zhihui_domain::{Decider, DomainEvent};

use super::Difference;
use crate::platform::event_store::RecordedEvent;

struct ClaimFold {
    promotion_id: PromotionId,
    user_id: Uuid,
    status: ClaimStatus,
    /// When it was reserved and granted (recorded), for the settlement bound.
    reserved_at: DateTime<Utc>,
    granted_at: Option<DateTime<Utc>>,
}

/// The user's claim that holds (or is about to hold) a unit: reserved or granted.
fn live_claim(
    promotion: &PromotionState,
    user_id: zhihui_domain::user::UserId,
) -> Option<&zhihui_domain::promotion::Claim> {
    promotion
        .claims
        .get(&user_id)
        .filter(|claim| claim.status != ClaimStatus::Refused)
}

#[derive(Default)]
pub(super) struct PromotionFold {
    promotions: HashMap<PromotionId, (Option<PromotionState>, u64)>,
    claims: HashMap<ClaimId, ClaimFold>,
    /// (user, amount) per claim credited / charged.
    credits: HashMap<ClaimId, Vec<(Uuid, Decimal)>>,
    charges: HashMap<ClaimId, Vec<(Uuid, Decimal)>>,
    broken: Vec<(String, String)>,
}

impl PromotionFold {
    pub(super) fn promotion_event(
        &mut self,
        promotion_id: PromotionId,
        recorded: &RecordedEvent,
    ) -> anyhow::Result<()> {
        let event = PromotionEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )?;
        let entry = self.promotions.entry(promotion_id).or_insert((None, 0));
        if let (Some(promotion), PromotionEvent::Reserved(e)) = (&entry.0, &event) {
            if let Some(live) = live_claim(promotion, e.user_id) {
                self.broken.push((
                    format!("{promotion_id} {}", e.user_id),
                    format!(
                        "claim {} reserved while {} was live",
                        e.claim_id, live.claim_id
                    ),
                ));
            }
            if promotion.taken >= promotion.spec.stock {
                self.broken.push((
                    promotion_id.to_string(),
                    format!(
                        "claim {} reserved with all {} units taken",
                        e.claim_id, promotion.spec.stock
                    ),
                ));
            }
        }
        match &event {
            PromotionEvent::Reserved(e) => {
                self.claims.insert(
                    e.claim_id,
                    ClaimFold {
                        promotion_id,
                        user_id: e.user_id.as_uuid(),
                        status: ClaimStatus::Reserved,
                        reserved_at: recorded.recorded_at,
                        granted_at: None,
                    },
                );
            }
            PromotionEvent::Granted(e) => {
                if let Some(claim) = self.claims.get_mut(&e.claim_id) {
                    claim.status = ClaimStatus::Granted;
                    claim.granted_at = Some(recorded.recorded_at);
                }
            }
            PromotionEvent::Refused(e) => {
                if let Some(claim) = self.claims.get_mut(&e.claim_id) {
                    claim.status = ClaimStatus::Refused;
                }
            }
            PromotionEvent::TurnedAway(e) => {
                if let Some(live) = entry
                    .0
                    .as_ref()
                    .and_then(|promotion| live_claim(promotion, e.user_id))
                {
                    self.broken.push((
                        format!("{promotion_id} {}", e.user_id),
                        format!(
                            "claim {} turned away over {}, which was live",
                            e.claim_id, live.claim_id
                        ),
                    ));
                }
                self.claims.insert(
                    e.claim_id,
                    ClaimFold {
                        promotion_id,
                        user_id: e.user_id.as_uuid(),
                        status: ClaimStatus::Refused,
                        reserved_at: recorded.recorded_at,
                        granted_at: None,
                    },
                );
            }
            _ => {}
        }
        entry.0 = Promotion::evolve(entry.0.take(), &event);
        entry.1 = recorded.stream_version;
        Ok(())
    }

    pub(super) fn account_event(&mut self, user_id: Uuid, event: &AccountEvent) {
        let (reference, amount, into) = match event {
            AccountEvent::Credited(credit) if credit.kind == CreditKind::Promotion => {
                (&credit.reference, credit.amount, &mut self.credits)
            }
            AccountEvent::Charged(charge) if charge.reason.starts_with("promotion:") => {
                (&charge.reason, charge.amount, &mut self.charges)
            }
            _ => return,
        };
        match parse_claim_reference(reference) {
            Some((_, claim_id)) => into
                .entry(claim_id)
                .or_default()
                .push((user_id, amount.as_decimal())),
            None => self.broken.push((
                user_id.to_string(),
                format!("a promotion movement names no claim: {reference:?}"),
            )),
        }
    }

    /// Compare; returns the granted claims still waiting for their credit within the bound.
    pub(super) async fn compare(
        &self,
        client: &tokio_postgres::Client,
        now: DateTime<Utc>,
        settle_within: chrono::Duration,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<usize> {
        let mut difference = |key: String, detail: String| {
            differences.push(Difference {
                read_model: "promotions",
                key,
                detail,
            });
        };
        for (key, detail) in &self.broken {
            difference(key.clone(), detail.clone());
        }
        let mut pending = 0;
        for (claim_id, claim) in &self.claims {
            let key = format!("claim {claim_id}");
            let promotion = self
                .promotions
                .get(&claim.promotion_id)
                .and_then(|(state, _)| state.as_ref());
            let credits = self.credits.get(claim_id).map_or(&[][..], Vec::as_slice);
            let charges = self.charges.get(claim_id).map_or(&[][..], Vec::as_slice);
            let Some(promotion) = promotion else {
                difference(key, "a claim of no promotion".into());
                continue;
            };
            match claim.status {
                ClaimStatus::Granted => {
                    if credits.len() > 1 {
                        difference(key.clone(), format!("credited {} times", credits.len()));
                    }
                    for (user, amount) in credits {
                        if *user != claim.user_id || *amount != promotion.spec.points.as_decimal() {
                            difference(
                                key.clone(),
                                format!(
                                    "credited {amount} to {user}; the claim is {}'s for {}",
                                    claim.user_id, promotion.spec.points
                                ),
                            );
                        }
                    }
                    if credits.is_empty() {
                        let granted_at = claim.granted_at.unwrap_or(now);
                        if now - granted_at > settle_within {
                            difference(key.clone(), "granted and never credited".into());
                        } else {
                            pending += 1;
                        }
                    }
                    let expected_charges = usize::from(promotion.spec.price.is_some());
                    if charges.len() != expected_charges {
                        difference(
                            key.clone(),
                            format!(
                                "charged {} times, price {:?}",
                                charges.len(),
                                promotion.spec.price
                            ),
                        );
                    }
                    for (user, amount) in charges {
                        if Some(*amount) != promotion.spec.price.map(|p| p.as_decimal())
                            || *user != claim.user_id
                        {
                            difference(key.clone(), format!("charged {amount} to {user}"));
                        }
                    }
                }
                ClaimStatus::Refused | ClaimStatus::Reserved => {
                    if !credits.is_empty() {
                        difference(key.clone(), "credited but not granted".into());
                    }
                    if claim.status == ClaimStatus::Refused && !charges.is_empty() {
                        difference(key.clone(), "charged but refused".into());
                    }
                    if claim.status == ClaimStatus::Reserved {
                        if now - claim.reserved_at > settle_within {
                            difference(key.clone(), "reserved and never granted or refused".into());
                        } else {
                            pending += 1;
                        }
                    }
                }
            }
        }
        for claim_id in self.credits.keys().chain(self.charges.keys()) {
            if !self.claims.contains_key(claim_id) {
                difference(
                    format!("claim {claim_id}"),
                    "a credit or charge for a claim never reserved".into(),
                );
            }
        }
        self.compare_read_models(client, differences).await?;
        Ok(pending)
    }

    async fn compare_read_models(
        &self,
        client: &tokio_postgres::Client,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<()> {
        use anyhow::Context;
        let rows = client
            .query(
                "SELECT promotion_id, stock, taken, granted, ended_at IS NOT NULL, stream_version
                   FROM promotions",
                &[],
            )
            .await
            .context("reading promotions")?;
        let mut seen = std::collections::HashSet::new();
        for row in rows {
            let promotion_id: Uuid = row.get(0);
            seen.insert(promotion_id);
            let shown = (
                i64::from(row.get::<_, i32>(1)),
                i64::from(row.get::<_, i32>(2)),
                i64::from(row.get::<_, i32>(3)),
                row.get::<_, bool>(4),
                row.get::<_, i64>(5),
            );
            let expected = self
                .promotions
                .get(&promotion_id)
                .and_then(|(state, version)| {
                    let state = state.as_ref()?;
                    Some((
                        i64::from(state.spec.stock),
                        i64::from(state.taken),
                        i64::from(state.granted),
                        state.ended_at.is_some(),
                        i64::try_from(*version).ok()?,
                    ))
                });
            if expected != Some(shown) {
                differences.push(Difference {
                    read_model: "promotions",
                    key: promotion_id.to_string(),
                    detail: format!(
                        "row says (stock, taken, granted, ended, version) {shown:?}; the events say {expected:?}"
                    ),
                });
            }
        }
        for (promotion_id, (state, _)) in &self.promotions {
            if state.is_some() && !seen.contains(promotion_id) {
                differences.push(Difference {
                    read_model: "promotions",
                    key: promotion_id.to_string(),
                    detail: "events without a row".into(),
                });
            }
        }
        let rows = client
            .query(
                "SELECT claim_id, user_id, status FROM promotion_claims",
                &[],
            )
            .await
            .context("reading promotion claims")?;
        let mut claims_seen = std::collections::HashSet::new();
        for row in rows {
            let claim_id: Uuid = row.get(0);
            claims_seen.insert(claim_id);
            let shown = (row.get::<_, Uuid>(1), row.get::<_, String>(2));
            let expected = self.claims.get(&claim_id).map(|claim| {
                (
                    claim.user_id,
                    match claim.status {
                        ClaimStatus::Reserved => "reserved",
                        ClaimStatus::Granted => "granted",
                        ClaimStatus::Refused => "refused",
                    }
                    .to_owned(),
                )
            });
            if expected.as_ref() != Some(&shown) {
                differences.push(Difference {
                    read_model: "promotion_claims",
                    key: claim_id.to_string(),
                    detail: format!("row says {shown:?}; the events say {expected:?}"),
                });
            }
        }
        for claim_id in self.claims.keys() {
            if !claims_seen.contains(claim_id) {
                differences.push(Difference {
                    read_model: "promotion_claims",
                    key: claim_id.to_string(),
                    detail: "claimed in the events, not in the table".into(),
                });
            }
        }
        Ok(())
    }
}
