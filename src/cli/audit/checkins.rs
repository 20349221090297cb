//! The check-in half of `audit verify`: every bonus credit against its check-in, and the
//! `checkins` read model against the events.
//!
//! What is checked:
//! - at most one bonus per user per day (over the account's credits), credited to the user who
//!   checked in, for the bonus the check-in decided;
//! - each check-in stream holds strictly later days, each streak counting the consecutive days
//!   before it;
//! - every check-in is credited, within the settlement bound (younger ones are pending);
//! - the `checkins` rows are the events' check-ins, each with its streak and bonus.
//!
//! Bonuses are part of the inflow that conservation checks (`PointsCredited`).

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, NaiveDate, Utc};
use rust_decimal::Decimal;
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::account::{AccountEvent, CreditKind};
use zhihui_domain::checkin::{CheckInEvent, CheckedIn, parse_bonus_reference};

use super::Difference;
use crate::platform::event_store::RecordedEvent;

#[derive(Default)]
pub(super) struct CheckInFold {
    /// Each user's check-ins by day, with when they were recorded.
    checkins: HashMap<Uuid, BTreeMap<NaiveDate, (CheckedIn, DateTime<Utc>)>>,
    /// Check-in events that broke the stream's order (a day not after the one before).
    out_of_order: Vec<(Uuid, NaiveDate)>,
    /// Bonus credits per user and day.
    credits: HashMap<(Uuid, NaiveDate), Vec<Decimal>>,
    /// Bonus credits whose reference names no day.
    unreadable: Vec<(Uuid, String)>,
}

impl CheckInFold {
    pub(super) fn checkin_event(
        &mut self,
        user_id: Uuid,
        recorded: &RecordedEvent,
    ) -> anyhow::Result<()> {
        let CheckInEvent::CheckedIn(event) = CheckInEvent::from_stored(
            &recorded.event_type,
            recorded.schema_version,
            &recorded.payload,
        )?;
        let days = self.checkins.entry(user_id).or_default();
        if days
            .last_key_value()
            .is_some_and(|(last, _)| *last >= event.day)
        {
            self.out_of_order.push((user_id, event.day));
            return Ok(());
        }
        days.insert(event.day, (event, recorded.recorded_at));
        Ok(())
    }

    pub(super) fn account_event(&mut self, user_id: Uuid, event: &AccountEvent) {
        let AccountEvent::Credited(credit) = event else {
            return;
        };
        if credit.kind != CreditKind::CheckInBonus {
            return;
        }
        match parse_bonus_reference(&credit.reference) {
            Some(day) => self
                .credits
                .entry((user_id, day))
                .or_default()
                .push(credit.amount.as_decimal()),
            None => self.unreadable.push((user_id, credit.reference.clone())),
        }
    }

    /// Compare; returns the check-ins still waiting for their bonus within the bound.
    pub(super) async fn compare(
        &self,
        client: &tokio_postgres::Client,
        now: DateTime<Utc>,
        settle_within: chrono::Duration,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<usize> {
        let mut difference = |key: String, detail: String| {
            differences.push(Difference {
                read_model: "checkins",
                key,
                detail,
            });
        };
        for (user_id, reference) in &self.unreadable {
            difference(
                user_id.to_string(),
                format!("a bonus credit names no day: {reference:?}"),
            );
        }
        for (user_id, day) in &self.out_of_order {
            difference(
                format!("{user_id} {day}"),
                "a check-in not after the one before it".into(),
            );
        }
        for ((user_id, day), amounts) in &self.credits {
            let key = format!("{user_id} {day}");
            if amounts.len() > 1 {
                difference(key.clone(), format!("{} bonuses on one day", amounts.len()));
            }
            match self.checkins.get(user_id).and_then(|days| days.get(day)) {
                None => difference(key, "a bonus without a check-in".into()),
                Some((checked_in, _)) => {
                    for amount in amounts {
                        if *amount != checked_in.bonus.as_decimal() {
                            difference(
                                key.clone(),
                                format!(
                                    "credited {amount} but the check-in decided {}",
                                    checked_in.bonus
                                ),
                            );
                        }
                    }
                }
            }
        }
        let mut pending = 0;
        for (user_id, days) in &self.checkins {
            for (day, (checked_in, recorded_at)) in days {
                let key = format!("{user_id} {day}");
                let mut expected = 1;
                while day
                    .checked_sub_days(chrono::Days::new(expected))
                    .is_some_and(|before| days.contains_key(&before))
                {
                    expected += 1;
                }
                if u64::from(checked_in.streak) != expected {
                    difference(
                        key.clone(),
                        format!(
                            "streak {} but {expected} consecutive days end here",
                            checked_in.streak
                        ),
                    );
                }
                if !self.credits.contains_key(&(*user_id, *day)) {
                    if now - *recorded_at > settle_within {
                        difference(key, "checked in and never credited".into());
                    } else {
                        pending += 1;
                    }
                }
            }
        }
        self.compare_read_model(client, differences).await?;
        Ok(pending)
    }

    async fn compare_read_model(
        &self,
        client: &tokio_postgres::Client,
        differences: &mut Vec<Difference>,
    ) -> anyhow::Result<()> {
        use anyhow::Context;
        let rows = client
            .query("SELECT user_id, day, streak, bonus FROM checkins", &[])
            .await
            .context("reading check-ins")?;
        let mut seen = std::collections::HashSet::new();
        for row in rows {
            let (user_id, day): (Uuid, NaiveDate) = (row.get(0), row.get(1));
            seen.insert((user_id, day));
            let shown = (i64::from(row.get::<_, i32>(2)), row.get::<_, Decimal>(3));
            let expected = self
                .checkins
                .get(&user_id)
                .and_then(|days| days.get(&day))
                .map(|(e, _)| (i64::from(e.streak), e.bonus.as_decimal()));
            if expected != Some(shown) {
                differences.push(Difference {
                    read_model: "checkins",
                    key: format!("{user_id} {day}"),
                    detail: format!(
                        "row says (streak, bonus) {shown:?}; the events say {expected:?}"
                    ),
                });
            }
        }
        for (user_id, days) in &self.checkins {
            for day in days.keys() {
                if !seen.contains(&(*user_id, *day)) {
                    differences.push(Difference {
                        read_model: "checkins",
                        key: format!("{user_id} {day}"),
                        detail: "checked in in the events, not in the table".into(),
                    });
                }
            }
        }
        Ok(())
    }
}
