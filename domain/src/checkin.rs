//! Daily check-in: a bonus once per user per calendar day, larger on configured streak days.
//!
//! One stream per user, `checkin-<user id>` ([`CheckIn`]): its events are the truth of which days
//! a user checked in and of every streak (Redis keeps bitmaps of them only to read fast). The
//! decision is made on the stream's latest version, so two check-ins of one day racing on two
//! processes append one event. The bonus is then credited on the account with an operation id
//! made from the user and the day ([`bonus_operation_id`]): however often it is retried (the
//! user's next check-in of that day, the settlement reconciler), it is credited once.
//!
//! A day is the calendar day at a fixed UTC offset (`auth.day_utc_offset_minutes`, UTC+8 by
//! default): [`day_of`].

use std::collections::BTreeSet;

use chrono::{DateTime, Duration, NaiveDate, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::decider::Decider;
use crate::event::{DecodeError, DomainEvent, expect_version, parse_payload, payload_of};
use crate::points::Amount;
use crate::user::UserId;

const STREAM_PREFIX: &str = "checkin-";

/// Namespace of the bonus credits' operation ids (UUIDv5 of user and day).
const BONUS_NAMESPACE: Uuid = Uuid::from_u128(0x5e1f_0c4e_c8a1_4d7b_9a0e_27c4_d1b3_77a2);

pub fn checkin_stream(user_id: UserId) -> String {
    format!("{STREAM_PREFIX}{user_id}")
}

pub fn user_of_checkin_stream(stream: &str) -> Option<UserId> {
    Uuid::parse_str(stream.strip_prefix(STREAM_PREFIX)?)
        .ok()
        .map(UserId::from_uuid)
}

/// The calendar day of `at` at a fixed offset from UTC, in minutes (480: UTC+8).
pub fn day_of(at: DateTime<Utc>, utc_offset_minutes: i32) -> NaiveDate {
    (at + Duration::minutes(i64::from(utc_offset_minutes))).date_naive()
}

/// The operation id of a day's bonus on the user's account: the same for every attempt.
pub fn bonus_operation_id(user_id: UserId, day: NaiveDate) -> Uuid {
    let mut name = user_id.as_uuid().as_bytes().to_vec();
    name.extend_from_slice(day.to_string().as_bytes());
    Uuid::new_v5(&BONUS_NAMESPACE, &name)
}

/// The `reference` of a bonus credit: `checkin:<YYYY-MM-DD>`.
pub fn bonus_reference(day: NaiveDate) -> String {
    format!("checkin:{day}")
}

/// The day a bonus credit's reference names.
pub fn parse_bonus_reference(reference: &str) -> Option<NaiveDate> {
    reference.strip_prefix("checkin:")?.parse().ok()
}

/// A larger bonus on every `every_days`-th consecutive day of a streak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreakReward {
    pub every_days: u32,
    pub bonus: Amount,
}

/// What a check-in is worth: the base bonus, or the largest streak reward that falls on the day.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BonusRule {
    pub base: Amount,
    pub rewards: Vec<StreakReward>,
}

impl BonusRule {
    pub fn bonus_for(&self, streak: u32) -> Amount {
        self.rewards
            .iter()
            .filter(|reward| reward.every_days > 0 && streak.is_multiple_of(reward.every_days))
            .map(|reward| reward.bonus)
            .fold(self.base, Amount::max)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckedIn {
    pub user_id: UserId,
    pub day: NaiveDate,
    /// Consecutive days ending with this one (1: the first, or after a missed day).
    pub streak: u32,
    pub bonus: Amount,
    pub at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckInEvent {
    CheckedIn(CheckedIn),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckInCommand {
    CheckIn {
        user_id: UserId,
        day: NaiveDate,
        rule: BonusRule,
        at: DateTime<Utc>,
    },
}

/// A check-in is never refused: a day already checked in (or older than the last check-in, as a
/// process whose clock is behind another's might ask) decides nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckInError {}

/// A user's check-ins: the last one is all a decision needs; every day is kept for the month
/// views (one date per day checked in: a few kilobytes after years).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CheckIns {
    pub last: Option<CheckedIn>,
    pub days: BTreeSet<NaiveDate>,
}

impl CheckIns {
    /// The streak as seen on `today`: the last check-in's when it was today or yesterday (it can
    /// still grow), else 0.
    pub fn streak_on(&self, today: NaiveDate) -> u32 {
        match &self.last {
            Some(last) if last.day == today || last.day.succ_opt() == Some(today) => last.streak,
            _ => 0,
        }
    }
}

#[derive(Debug)]
pub struct CheckIn;

impl Decider for CheckIn {
    type State = CheckIns;
    type Command = CheckInCommand;
    type Event = CheckInEvent;
    type Error = CheckInError;

    fn initial_state() -> CheckIns {
        CheckIns::default()
    }

    fn decide(
        state: &CheckIns,
        command: &CheckInCommand,
    ) -> Result<Vec<CheckInEvent>, CheckInError> {
        let CheckInCommand::CheckIn {
            user_id,
            day,
            rule,
            at,
        } = command;
        let streak = match &state.last {
            Some(last) if last.day >= *day => return Ok(vec![]),
            Some(last) if last.day.succ_opt() == Some(*day) => last.streak.saturating_add(1),
            _ => 1,
        };
        Ok(vec![CheckInEvent::CheckedIn(CheckedIn {
            user_id: *user_id,
            day: *day,
            streak,
            bonus: rule.bonus_for(streak),
            at: *at,
        })])
    }

    fn evolve(mut state: CheckIns, event: &CheckInEvent) -> CheckIns {
        let CheckInEvent::CheckedIn(e) = event;
        state.days.insert(e.day);
        // The decider only appends later days; a fold keeps the latest as the last.
        if state.last.as_ref().is_none_or(|last| last.day < e.day) {
            state.last = Some(e.clone());
        }
        state
    }
}

impl DomainEvent for CheckInEvent {
    fn event_type(&self) -> &'static str {
        "CheckedIn"
    }

    fn schema_version(&self) -> u32 {
        1
    }

    fn to_payload(&self) -> crate::event::Payload {
        let CheckInEvent::CheckedIn(e) = self;
        payload_of(e)
    }

    fn from_stored(
        event_type: &str,
        schema_version: u32,
        payload: &crate::event::Payload,
    ) -> Result<CheckInEvent, DecodeError> {
        match event_type {
            "CheckedIn" => {
                expect_version(event_type, schema_version, 1)?;
                Ok(CheckInEvent::CheckedIn(parse_payload(event_type, payload)?))
            }
            other => Err(DecodeError::UnknownType {
                event_type: other.to_owned(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::decider::given;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn amount(text: &str) -> Amount {
        Amount::parse(text.parse().unwrap()).unwrap()
    }

    fn rule() -> BonusRule {
        BonusRule {
            base: amount("5"),
            rewards: vec![
                StreakReward {
                    every_days: 7,
                    bonus: amount("20"),
                },
                StreakReward {
                    every_days: 30,
                    bonus: amount("100"),
                },
            ],
        }
    }

    fn day(text: &str) -> NaiveDate {
        text.parse().unwrap()
    }

    fn user() -> UserId {
        UserId::from_uuid(Uuid::from_u128(7))
    }

    fn at() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap()
    }

    fn checked_in(on: &str, streak: u32, bonus: &str) -> CheckInEvent {
        CheckInEvent::CheckedIn(CheckedIn {
            user_id: user(),
            day: day(on),
            streak,
            bonus: amount(bonus),
            at: at(),
        })
    }

    fn check_in(on: &str) -> CheckInCommand {
        CheckInCommand::CheckIn {
            user_id: user(),
            day: day(on),
            rule: rule(),
            at: at(),
        }
    }

    #[test]
    fn a_first_check_in_starts_a_streak_of_one() {
        given::<CheckIn>(&[])
            .when(check_in("2027-01-15"))
            .then(&[checked_in("2027-01-15", 1, "5")]);
    }

    #[test]
    fn the_next_day_grows_the_streak_across_a_year_end() {
        given::<CheckIn>(&[checked_in("2026-12-31", 3, "5")])
            .when(check_in("2027-01-01"))
            .then(&[checked_in("2027-01-01", 4, "5")]);
    }

    #[test]
    fn the_streak_crosses_a_leap_day() {
        given::<CheckIn>(&[checked_in("2028-02-28", 1, "5")])
            .when(check_in("2028-02-29"))
            .then(&[checked_in("2028-02-29", 2, "5")]);
        given::<CheckIn>(&[checked_in("2028-02-29", 2, "5")])
            .when(check_in("2028-03-01"))
            .then(&[checked_in("2028-03-01", 3, "5")]);
    }

    #[test]
    fn a_missed_day_starts_again_at_one() {
        given::<CheckIn>(&[checked_in("2027-01-13", 6, "5")])
            .when(check_in("2027-01-15"))
            .then(&[checked_in("2027-01-15", 1, "5")]);
    }

    #[test]
    fn the_same_day_again_decides_nothing() {
        given::<CheckIn>(&[checked_in("2027-01-15", 2, "5")])
            .when(check_in("2027-01-15"))
            .then(&[]);
    }

    #[test]
    fn a_day_before_the_last_check_in_decides_nothing() {
        given::<CheckIn>(&[checked_in("2027-01-15", 2, "5")])
            .when(check_in("2027-01-14"))
            .then(&[]);
    }

    #[test]
    fn the_seventh_day_earns_the_streak_reward_and_the_thirtieth_the_larger_one() {
        given::<CheckIn>(&[checked_in("2027-01-14", 6, "5")])
            .when(check_in("2027-01-15"))
            .then(&[checked_in("2027-01-15", 7, "20")]);
        assert_eq!(rule().bonus_for(30), amount("100"));
        assert_eq!(
            rule().bonus_for(210),
            amount("100"),
            "both fall: the larger"
        );
        assert_eq!(rule().bonus_for(8), amount("5"));
    }

    #[test]
    fn the_streak_on_a_day_is_the_last_one_while_it_can_still_grow() {
        let state = CheckIn::fold(&[checked_in("2027-01-15", 4, "5")]);
        assert_eq!(state.streak_on(day("2027-01-15")), 4);
        assert_eq!(state.streak_on(day("2027-01-16")), 4);
        assert_eq!(state.streak_on(day("2027-01-17")), 0);
        assert_eq!(CheckIns::default().streak_on(day("2027-01-17")), 0);
    }

    #[test]
    fn the_day_is_the_calendar_day_at_the_offset() {
        // 23:59:59.999 and 00:00:00.000 at UTC+8.
        let before =
            Utc.with_ymd_and_hms(2027, 1, 15, 15, 59, 59).unwrap() + Duration::milliseconds(999);
        let after = Utc.with_ymd_and_hms(2027, 1, 15, 16, 0, 0).unwrap();
        assert_eq!(day_of(before, 480), day("2027-01-15"));
        assert_eq!(day_of(after, 480), day("2027-01-16"));
        assert_eq!(day_of(after, 0), day("2027-01-15"));
    }

    #[test]
    fn references_and_operation_ids_name_the_day() {
        let today = day("2027-01-15");
        assert_eq!(parse_bonus_reference(&bonus_reference(today)), Some(today));
        assert_eq!(parse_bonus_reference("code:x:1"), None);
        assert_eq!(
            bonus_operation_id(user(), today),
            bonus_operation_id(user(), today)
        );
        assert_ne!(
            bonus_operation_id(user(), today),
            bonus_operation_id(user(), day("2027-01-16"))
        );
        assert_ne!(
            bonus_operation_id(user(), today),
            bonus_operation_id(UserId::from_uuid(Uuid::from_u128(8)), today)
        );
        assert_eq!(
            user_of_checkin_stream(&checkin_stream(user())),
            Some(user())
        );
    }

    proptest! {
        /// Any order of check-in days: the streak of each appended day is the number of
        /// consecutive days ending with it among those appended, and no day is appended twice.
        #[test]
        fn streaks_count_consecutive_days(offsets in proptest::collection::vec(0_i64..40, 1..60)) {
            let start = day("2026-12-20");
            let mut events: Vec<CheckInEvent> = Vec::new();
            for offset in offsets {
                let on = start + Duration::days(offset);
                let state = CheckIn::fold(&events);
                let decided = CheckIn::decide(&state, &CheckInCommand::CheckIn {
                    user_id: user(), day: on, rule: rule(), at: at(),
                }).unwrap();
                events.extend(decided);
            }
            let days: Vec<NaiveDate> = events.iter().map(|CheckInEvent::CheckedIn(e)| e.day).collect();
            for pair in days.windows(2) {
                prop_assert!(pair[0] < pair[1]);
            }
            for CheckInEvent::CheckedIn(e) in &events {
                let mut expected = 1;
                while days.contains(&(e.day - Duration::days(i64::from(expected)))) {
                    expected += 1;
                }
                prop_assert_eq!(e.streak, expected);
                prop_assert_eq!(e.bonus, rule().bonus_for(expected));
            }
        }
    }
}
