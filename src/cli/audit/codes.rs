//! The redeem-code half of `audit verify`: every code credit against its code's redemption and
//! batch, and the `code_batches` / `redeem_codes` read models against the events.
//!
//! A code's redemption is its credit when the credit carries the event id derived from the code
//! (one append: the store holds that id once), or the `CodeRedeemed` of its own stream (codes
//! redeemed before, or on KurrentDB), which the credit follows.
//!
//! What is checked:
//! - a code is credited at most once over all accounts, to the user who redeemed it, for its
//!   batch's points; a credit that is not the redemption itself follows one in the code's stream;
//!   it was redeemed inside its batch's window and only once issued;
//! - every redemption is credited, within the settlement bound (younger ones are pending: a
//!   request between the code's stream and the account right now, or one that died and awaits
//!   the settlement reconciler);
//! - each batch row shows its events' range, progress and revocation; each batch has one code row
//!   per issued serial, and each redeemed row names its redeemer.
//!
//! Code credits are part of the inflow that conservation checks (`PointsCredited`).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use uuid::Uuid;
use zhihui_domain::account::{AccountEvent, CreditKind};
use zhihui_domain::redeem::{
    Batch, BatchEvent, BatchId, CodeBatch, CodeRedeemed, RedemptionEvent, credit_event_id,
    parse_credit_reference,
};
use zhihui_domain::{Decider, DomainEvent};

use super::Difference;
use crate::platform::event_store::RecordedEvent;

struct Credit {
    user_id: Uuid,
    batch_id: BatchId,
    amount: Decimal,
    at: DateTime<Utc>,
    /// Stored under the id derived from its code: the credit is the redemption.
    under_code_id: bool,
}

#[derive(Default)]
pub(super) struct CodeFold {
    batches: HashMap<BatchId, (Option<Batch>, u64)>,
    /// The first redemption of each serial, and how many events its stream has.
    redemptions: HashMap<u32, (CodeRedeemed, usize, DateTime<Utc>)>,
    credits: HashMap<u32, Vec<Credit>>,
    /// Code credits whose reference names no code.
    unreadable: Vec<(Uuid, String)>,
}

impl CodeFold {
    pub(super) fn batch_event(
        &mut self,
        batch_id: BatchId,
        recorded: &RecordedEvent,
    ) -> anyhow::Result<()> {
        let event = BatchEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )?;
        let entry = self.batches.entry(batch_id).or_insert((None, 0));
        entry.0 = CodeBatch::evolve(entry.0.take(), &event);
        entry.1 = recorded.stream_version;
        Ok(())
    }

    pub(super) fn code_event(&mut self, recorded: &RecordedEvent) -> anyhow::Result<()> {
        let RedemptionEvent::Redeemed(event) = RedemptionEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )?;
        self.redemptions
            .entry(event.serial)
            .and_modify(|(_, events, _)| *events += 1)
            .or_insert((event, 1, recorded.recorded_at));
        Ok(())
    }

    pub(super) fn account_event(&mut self, user_id: Uuid, event_id: Uuid, event: &AccountEvent) {
        let AccountEvent::Credited(credit) = event else {
            return;
        };
        if credit.kind != CreditKind::RedeemCode {
            return;
        }
        match parse_credit_reference(&credit.reference) {
            Some((batch_id, serial)) => self.credits.entry(serial).or_default().push(Credit {
                user_id,
                batch_id,
                amount: credit.amount.as_decimal(),
                at: credit.at,
                under_code_id: event_id == credit_event_id(serial),
            }),
            None => self.unreadable.push((user_id, credit.reference.clone())),
        }
    }

    /// Who redeemed `serial`, by the events: its own stream's redeemer, or the account whose
    /// credit carries the code's id.
    fn redeemer(&self, serial: u32) -> Option<Uuid> {
        match self.redemptions.get(&serial) {
            Some((redeemed, _, _)) => Some(redeemed.user_id.as_uuid()),
            None => self
                .credits
                .get(&serial)?
                .iter()
                .find(|credit| credit.under_code_id)
                .map(|credit| credit.user_id),
        }
    }

    /// Compare; returns the redemptions still waiting for their credit within the bound.
    pub(super) async fn compare(
        &self,
        client: &tokio_postgres::Client,
        now: DateTime<Utc>,
        settle_within: chrono::Duration,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<usize> {
        let mut difference = |key: String, detail: String| {
            differences.push(Difference {
                read_model: "codes",
                key,
                detail,
            });
        };
        for (user_id, reference) in &self.unreadable {
            difference(
                user_id.to_string(),
                format!("a code credit names no code: {reference:?}"),
            );
        }
        let batch = |batch_id: &BatchId| self.batches.get(batch_id).and_then(|(b, _)| b.as_ref());
        // Where a batch says a redemption could not have happened.
        let redemption_differences =
            |serial: u32, batch_id: BatchId, at: DateTime<Utc>, points: Decimal| {
                let mut found = Vec::new();
                match batch(&batch_id) {
                    None => found.push("redeemed from a batch that does not exist".to_owned()),
                    Some(batch) => {
                        if !batch.has_issued(serial) {
                            found.push("redeemed but never issued".into());
                        }
                        if !batch.spec.valid_at(at) {
                            found.push(format!(
                                "redeemed at {at} outside its window {} .. {}",
                                batch.spec.valid_from, batch.spec.valid_until
                            ));
                        }
                        if batch.spec.points.as_decimal() != points {
                            found.push("redeemed for another amount than its batch's".into());
                        }
                    }
                }
                found
            };
        for (serial, credits) in &self.credits {
            let key = format!("serial {serial}");
            if credits.len() > 1 {
                difference(key.clone(), format!("credited {} times", credits.len()));
            }
            let in_its_stream = self.redemptions.contains_key(serial);
            let redeemer = self.redeemer(*serial);
            for credit in credits {
                if !in_its_stream && credit.under_code_id {
                    // The credit is the redemption: the batch must allow it.
                    for detail in
                        redemption_differences(*serial, credit.batch_id, credit.at, credit.amount)
                    {
                        difference(key.clone(), detail);
                    }
                }
                match redeemer {
                    None => difference(
                        key.clone(),
                        format!("credited to {} but never redeemed", credit.user_id),
                    ),
                    Some(redeemer) if redeemer != credit.user_id => difference(
                        key.clone(),
                        format!("credited to {} but redeemed by {redeemer}", credit.user_id),
                    ),
                    Some(_) => {}
                }
                match batch(&credit.batch_id) {
                    None => difference(
                        key.clone(),
                        format!(
                            "credited from batch {}, which does not exist",
                            credit.batch_id
                        ),
                    ),
                    Some(batch) if batch.spec.points.as_decimal() != credit.amount => difference(
                        key.clone(),
                        format!(
                            "credited {} but its batch is worth {}",
                            credit.amount, batch.spec.points
                        ),
                    ),
                    Some(_) => {}
                }
            }
        }
        let mut pending = 0;
        for (serial, (redeemed, events, recorded_at)) in &self.redemptions {
            let key = format!("serial {serial}");
            if *events > 1 {
                difference(key.clone(), format!("{events} redemption events"));
            }
            for detail in redemption_differences(
                *serial,
                redeemed.batch_id,
                redeemed.at,
                redeemed.points.as_decimal(),
            ) {
                difference(key.clone(), detail);
            }
            if !self.credits.contains_key(serial) {
                if now - *recorded_at > settle_within {
                    difference(
                        key.clone(),
                        format!("redeemed by {} and never credited", redeemed.user_id),
                    );
                } else {
                    pending += 1;
                }
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
        let mut difference = |key: String, detail: String| {
            differences.push(Difference {
                read_model: "code_batches",
                key,
                detail,
            });
        };
        let rows = client
            .query(
                "SELECT b.batch_id, b.first_serial, b.count, b.issued, b.points, b.revoked_at IS NOT NULL,
                        b.stream_version,
                        (SELECT count(*) FROM redeem_codes c WHERE c.batch_id = b.batch_id)
                   FROM code_batches b",
                &[],
            )
            .await
            .context("reading code batches")?;
        let mut seen = std::collections::HashSet::new();
        for row in rows {
            let batch_id: Uuid = row.get(0);
            seen.insert(batch_id);
            let shown = (
                i64::from(row.get::<_, i32>(1)),
                i64::from(row.get::<_, i32>(2)),
                i64::from(row.get::<_, i32>(3)),
                row.get::<_, Decimal>(4),
                row.get::<_, bool>(5),
                row.get::<_, i64>(6),
                row.get::<_, i64>(7),
            );
            let expected = self.batches.get(&batch_id).and_then(|(batch, version)| {
                let batch = batch.as_ref()?;
                Some((
                    i64::from(batch.first_serial),
                    i64::from(batch.spec.count),
                    i64::from(batch.issued),
                    batch.spec.points.as_decimal(),
                    batch.revoked_at.is_some(),
                    i64::try_from(*version).ok()?,
                    i64::from(batch.issued),
                ))
            });
            if expected != Some(shown) {
                difference(
                    batch_id.to_string(),
                    format!(
                        "row says (first, count, issued, points, revoked, version, code rows) {shown:?}; the events say {expected:?}"
                    ),
                );
            }
        }
        for (batch_id, (batch, _)) in &self.batches {
            if batch.is_some() && !seen.contains(batch_id) {
                difference(batch_id.to_string(), "events without a row".into());
            }
        }
        let rows = client
            .query(
                "SELECT serial, redeemed_by FROM redeem_codes WHERE redeemed_by IS NOT NULL",
                &[],
            )
            .await
            .context("reading redeemed codes")?;
        let mut redeemed_seen = std::collections::HashSet::new();
        for row in rows {
            let serial = u32::try_from(row.get::<_, i32>(0))?;
            let by: Uuid = row.get(1);
            redeemed_seen.insert(serial);
            let expected = self.redeemer(serial);
            if expected != Some(by) {
                differences.push(Difference {
                    read_model: "redeem_codes",
                    key: format!("serial {serial}"),
                    detail: format!("row says redeemed by {by}; the events say {expected:?}"),
                });
            }
        }
        let redeemed_serials: std::collections::BTreeSet<&u32> = self
            .redemptions
            .keys()
            .chain(
                self.credits
                    .iter()
                    .filter(|(_, credits)| credits.iter().any(|credit| credit.under_code_id))
                    .map(|(serial, _)| serial),
            )
            .collect();
        for serial in redeemed_serials {
            if !redeemed_seen.contains(serial) {
                differences.push(Difference {
                    read_model: "redeem_codes",
                    key: format!("serial {serial}"),
                    detail: "redeemed in the events, not in the table".into(),
                });
            }
        }
        Ok(())
    }
}
