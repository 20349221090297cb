//! Daily check-in: the bonus once per user per calendar day, the month view and the streak.
//!
//! The truth is the user's `checkin-<user>` stream ([`CheckIn`], decided on its latest version:
//! two check-ins of one day racing on two processes append one event). The bonus is then
//! credited on the account with an operation id made of the user and the day, so a repeat of the
//! check-in (the same day, any process) credits what a request that died in between did not, and
//! the settlement reconciler ([`CheckInService::repair_credits_once`]) credits the rest.
//!
//! Redis keeps one bitmap per user and month (`checkins:<user>:<YYYY-MM>`) for the fast read:
//! bit `d` is day `d` of the month and bit 0 says the month was written from the events (a month
//! key without it, or no key, is rebuilt from the stream when read: "not in Redis" never means
//! "not checked in"). Bits are only ever set, never cleared (a check-in is never undone), so
//! writers racing each other cannot lose a day. A check-in writes this month and the last from
//! the state it decided on, so the months a streak is read from are healed by every check-in.

use std::collections::BTreeSet;

use anyhow::Context;
use chrono::{Datelike, Months, NaiveDate};
use deadpool_postgres::Pool;
use uuid::Uuid;
use zhihui_domain::account::{Account, AccountCommand, AccountState, CreditKind, account_stream};
use zhihui_domain::checkin::{
    BonusRule, CheckIn, CheckInCommand, CheckIns, CheckedIn, bonus_operation_id, bonus_reference,
    checkin_stream, day_of,
};
use zhihui_domain::points::Amount;
use zhihui_domain::user::UserId;

use crate::platform::aggregate::AggregateService;
use crate::platform::clock::Clock;
use crate::platform::command::{self, CommandError, RetryPolicy};
use crate::platform::configuration::CheckInSettings;
use crate::platform::event_store::{AnyEventStore, EventMetadata};
use crate::platform::redis_store::RedisStore;

/// The bit of a month's bitmap that says it was written from the events.
const COMPLETE_BIT: u32 = 0;

/// What a check-in answers (also a repeat the same day).
#[derive(Debug, Clone)]
pub struct CheckInResult {
    pub day: NaiveDate,
    /// Consecutive days ending with `day`.
    pub streak: u32,
    pub bonus: Amount,
    /// False when the day was checked in before (nothing credited again).
    pub checked_in_now: bool,
    pub account: AccountState,
}

/// One month of a user's check-ins, and the streak as of today.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MonthView {
    /// The month's first day.
    pub month: NaiveDate,
    pub today: NaiveDate,
    pub days: Vec<NaiveDate>,
    /// Consecutive days ending today, or yesterday while today is not checked in yet (it can
    /// still grow); 0 otherwise.
    pub streak: u32,
    pub checked_in_today: bool,
}

#[derive(Debug, Clone)]
pub struct CheckInService {
    store: AnyEventStore,
    accounts: AggregateService<Account>,
    pool: Pool,
    redis: RedisStore,
    clock: Clock,
    rule: BonusRule,
    day_utc_offset_minutes: i32,
    keep_seconds: i64,
}

/// The first day of `day`'s month.
pub fn month_of(day: NaiveDate) -> NaiveDate {
    day.with_day(1).unwrap_or(day)
}

/// `YYYY-MM` as the month's first day.
pub fn parse_month(text: &str) -> Option<NaiveDate> {
    let (year, month) = text.split_once('-')?;
    if year.len() != 4 || month.len() != 2 {
        return None;
    }
    NaiveDate::from_ymd_opt(year.parse().ok()?, month.parse().ok()?, 1)
}

fn previous_month(month: NaiveDate) -> NaiveDate {
    month.checked_sub_months(Months::new(1)).unwrap_or(month)
}

/// A month's bitmap as Redis holds it: bit offset `n` is bit `7 - n % 8` of byte `n / 8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct MonthBits(u32);

impl MonthBits {
    fn from_redis(bytes: &[u8]) -> MonthBits {
        let mut padded = [0u8; 4];
        for (slot, byte) in padded.iter_mut().zip(bytes) {
            *slot = *byte;
        }
        MonthBits(u32::from_be_bytes(padded))
    }

    fn of_days(month: NaiveDate, days: &BTreeSet<NaiveDate>) -> MonthBits {
        let end = month.checked_add_months(Months::new(1)).unwrap_or(month);
        let mut bits = MonthBits::default().with(COMPLETE_BIT);
        for day in days.range(month..end) {
            bits = bits.with(day.day());
        }
        bits
    }

    fn with(self, offset: u32) -> MonthBits {
        MonthBits(self.0 | (1 << (31 - offset)))
    }

    fn has(self, offset: u32) -> bool {
        self.0 & (1 << (31 - offset)) != 0
    }

    fn complete(self) -> bool {
        self.has(COMPLETE_BIT)
    }

    fn days(self, month: NaiveDate) -> Vec<NaiveDate> {
        (1..=31)
            .filter(|day| self.has(*day))
            .filter_map(|day| month.with_day(day))
            .collect()
    }
}

impl CheckInService {
    pub fn new(
        store: AnyEventStore,
        accounts: AggregateService<Account>,
        pool: Pool,
        redis: RedisStore,
        clock: Clock,
        settings: &CheckInSettings,
        day_utc_offset_minutes: i32,
    ) -> anyhow::Result<CheckInService> {
        Ok(CheckInService {
            store,
            accounts,
            pool,
            redis,
            clock,
            rule: settings.rule()?,
            day_utc_offset_minutes,
            keep_seconds: i64::from(settings.redis_keep_days) * 86_400,
        })
    }

    /// The platform's UTC offset in minutes (its calendar days; the pages show times in it).
    pub fn day_offset_minutes(&self) -> i32 {
        self.day_utc_offset_minutes
    }

    /// The bonus rule (the pages show what the next check-in brings).
    pub fn rule(&self) -> &BonusRule {
        &self.rule
    }

    /// Today, on the platform's calendar.
    pub fn today(&self) -> NaiveDate {
        day_of(self.clock.now(), self.day_utc_offset_minutes)
    }

    fn month_key(&self, user_id: UserId, month: NaiveDate) -> String {
        // One user's months share a tag: they are read together (MGET) and written together.
        self.redis.tagged(
            &crate::platform::redis_store::user_tag(user_id),
            &format!("checkins:{}", month.format("%Y-%m")),
        )
    }

    /// Check the caller in for today: the bonus once per day, whatever the retries.
    pub async fn check_in(
        &self,
        user_id: UserId,
        metadata: &EventMetadata,
    ) -> anyhow::Result<CheckInResult> {
        let now = self.clock.now();
        let today = day_of(now, self.day_utc_offset_minutes);
        let command = CheckInCommand::CheckIn {
            user_id,
            day: today,
            rule: self.rule.clone(),
            at: now,
        };
        let executed = command::execute::<CheckIn>(
            &self.store,
            &checkin_stream(user_id),
            &command,
            metadata,
            RetryPolicy::default(),
        )
        .await
        .map_err(|error| match error {
            CommandError::Rejected(never) => match never {},
            contended_or_away => contended_or_away.into_anyhow("checking in"),
        })?;
        let checked_in_now = !executed.new_events.is_empty();
        let state = executed.state;
        // Today's check-in, or (a process whose clock is behind another's) a later one.
        let last = state
            .last
            .clone()
            .context("a check-in leaves a last check-in")?;
        let (account, _) = self.credit(&last, metadata).await?;
        if let Err(error) = self.write_months(user_id, &state, today).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), %user_id, "check-in bitmaps not written; the next read rebuilds them");
        }
        Ok(CheckInResult {
            day: last.day,
            streak: last.streak,
            bonus: last.bonus,
            checked_in_now,
            account,
        })
    }

    /// Credit a check-in's bonus (idempotent by the user and day). Returns the account state and
    /// whether this call credited it.
    async fn credit(
        &self,
        checked_in: &CheckedIn,
        metadata: &EventMetadata,
    ) -> anyhow::Result<(AccountState, bool)> {
        let handled = self
            .accounts
            .execute(
                &account_stream(checked_in.user_id),
                AccountCommand::Credit {
                    operation_id: bonus_operation_id(checked_in.user_id, checked_in.day),
                    kind: CreditKind::CheckInBonus,
                    amount: checked_in.bonus,
                    reference: bonus_reference(checked_in.day),
                    at: checked_in.at,
                },
                metadata.clone(),
            )
            .await
            .map_err(|error| {
                error.into_anyhow(format!(
                    "crediting the check-in of {} on {}",
                    checked_in.user_id, checked_in.day
                ))
            })?;
        Ok((handled.state_after, !handled.new_events.is_empty()))
    }

    /// Write today's month and the one before from `state` (set bits only, and the complete bit).
    async fn write_months(
        &self,
        user_id: UserId,
        state: &CheckIns,
        today: NaiveDate,
    ) -> anyhow::Result<()> {
        let month = month_of(today);
        self.write_bits(
            user_id,
            &[month, previous_month(month)]
                .map(|month| (month, MonthBits::of_days(month, &state.days))),
        )
        .await
    }

    async fn write_bits(
        &self,
        user_id: UserId,
        months: &[(NaiveDate, MonthBits)],
    ) -> anyhow::Result<()> {
        let mut pipe = redis::pipe();
        for (month, bits) in months {
            let key = self.month_key(user_id, *month);
            // BITFIELD SET u1 only sets what it names: a bit another writer set stays set.
            let mut bitfield = redis::cmd("BITFIELD");
            bitfield.arg(&key);
            for offset in (0..32).filter(|offset| bits.has(*offset)) {
                bitfield.arg("SET").arg("u1").arg(offset).arg(1);
            }
            pipe.add_command(bitfield).ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(self.keep_seconds).ignore();
        }
        let mut connection = self.redis.connection().await?;
        pipe.query_async::<()>(&mut connection)
            .await
            .context("writing check-in bitmaps")
    }

    /// The stream's state: every day checked in.
    async fn load(&self, user_id: UserId) -> anyhow::Result<CheckIns> {
        Ok(
            command::load::<CheckIn>(&self.store, &checkin_stream(user_id))
                .await?
                .state,
        )
    }

    /// One month of check-ins and the streak: from Redis when it holds the months, else (and
    /// when Redis does not answer) from the events, writing Redis back.
    pub async fn month(&self, user_id: UserId, month: NaiveDate) -> anyhow::Result<MonthView> {
        let today = self.today();
        let month = month_of(month);
        let current = month_of(today);
        let mut wanted = vec![month, current, previous_month(current)];
        wanted.sort();
        wanted.dedup();
        let cached = match self.read_bits(user_id, &wanted).await {
            Ok(cached) => Some(cached),
            Err(error) => {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "check-in bitmaps unreadable; reading the events");
                None
            }
        };
        let complete = cached
            .as_ref()
            .filter(|bits| bits.iter().all(|(_, bits)| bits.complete()));
        if let Some(bits) = complete {
            let bits_of = |wanted_month: NaiveDate| {
                bits.iter()
                    .find(|(month, _)| *month == wanted_month)
                    .map(|(_, bits)| *bits)
                    .unwrap_or_default()
            };
            if let Some(streak) = streak_from_bits(today, &bits_of) {
                return Ok(MonthView {
                    month,
                    today,
                    days: bits_of(month).days(month),
                    streak,
                    checked_in_today: bits_of(current).has(today.day()),
                });
            }
        }
        // Some month is missing or incomplete, or the streak goes back further than the months
        // read: the events answer, and Redis gets the months back.
        let state = self.load(user_id).await?;
        if cached.is_some() {
            let months = wanted
                .iter()
                .map(|month| (*month, MonthBits::of_days(*month, &state.days)))
                .collect::<Vec<_>>();
            if let Err(error) = self.write_bits(user_id, &months).await {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "check-in bitmaps not written back");
            }
        }
        Ok(MonthView {
            month,
            today,
            days: MonthBits::of_days(month, &state.days).days(month),
            streak: state.streak_on(today),
            checked_in_today: state.days.contains(&today),
        })
    }

    async fn read_bits(
        &self,
        user_id: UserId,
        months: &[NaiveDate],
    ) -> anyhow::Result<Vec<(NaiveDate, MonthBits)>> {
        let keys = months
            .iter()
            .map(|month| self.month_key(user_id, *month))
            .collect::<Vec<_>>();
        let mut connection = self.redis.connection().await?;
        let values: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut connection)
            .await
            .context("reading check-in bitmaps")?;
        Ok(months
            .iter()
            .zip(values)
            .map(|(month, value)| {
                (
                    *month,
                    value.map_or_else(MonthBits::default, |bytes| MonthBits::from_redis(&bytes)),
                )
            })
            .collect())
    }

    /// Write every month of a user's check-ins back to Redis from the stream; the months written.
    pub async fn rebuild_user(&self, user_id: UserId) -> anyhow::Result<usize> {
        let state = self.load(user_id).await?;
        let (Some(first), Some(last)) = (state.days.first(), state.days.last()) else {
            return Ok(0);
        };
        let mut months = Vec::new();
        let mut month = month_of(*first);
        while month <= month_of(*last) {
            months.push((month, MonthBits::of_days(month, &state.days)));
            month = month
                .checked_add_months(Months::new(1))
                .context("a month after the last")?;
        }
        self.write_bits(user_id, &months).await?;
        Ok(months.len())
    }

    /// [`Self::rebuild_user`] for every user the `checkins` read model knows (a user whose first
    /// check-in is not projected yet is rebuilt lazily by their next read). Returns (users,
    /// months).
    pub async fn rebuild_all(&self) -> anyhow::Result<(usize, usize)> {
        let users: Vec<Uuid> = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query("SELECT DISTINCT user_id FROM checkins", &[])
                .await
                .context("reading users who checked in")?
                .iter()
                .map(|row| row.get(0))
                .collect()
        };
        let mut months = 0;
        for user_id in &users {
            months += self.rebuild_user(UserId::from_uuid(*user_id)).await?;
        }
        Ok((users.len(), months))
    }

    /// Credit every check-in more than `after` old whose bonus the `checkins` read model has not
    /// seen credited (the request died between the check-in stream and the account). Returns the
    /// repairs made (user, day, checked in at).
    pub async fn repair_credits_once(
        &self,
        after: chrono::Duration,
        limit: i64,
        metadata: &EventMetadata,
    ) -> anyhow::Result<Vec<(Uuid, NaiveDate, chrono::DateTime<chrono::Utc>)>> {
        let cutoff = self.clock.now() - after;
        let rows = {
            let client = crate::platform::postgres::checkout(&self.pool)
                .await
                .context("getting a connection")?;
            client
                .query(
                    "SELECT user_id, day FROM checkins
                      WHERE credited_at IS NULL AND checked_in_at <= $1
                      ORDER BY checked_in_at LIMIT $2",
                    &[&cutoff, &limit],
                )
                .await
                .context("reading uncredited check-ins")?
        };
        let mut repairs = Vec::new();
        for row in rows {
            let user_id = UserId::from_uuid(row.get(0));
            let day: NaiveDate = row.get(1);
            let state = self.load(user_id).await?;
            let Some(checked_in) = self.checked_in_on(user_id, &state, day).await? else {
                continue;
            };
            let (_, credited_now) = self.credit(&checked_in, metadata).await?;
            if credited_now {
                repairs.push((user_id.as_uuid(), day, checked_in.at));
            }
        }
        Ok(repairs)
    }

    /// The `CheckedIn` event of one day (the state keeps only the last one's details).
    async fn checked_in_on(
        &self,
        user_id: UserId,
        state: &CheckIns,
        day: NaiveDate,
    ) -> anyhow::Result<Option<CheckedIn>> {
        if let Some(last) = state.last.as_ref().filter(|last| last.day == day) {
            return Ok(Some(last.clone()));
        }
        let mut found = None;
        command::load_inspecting::<CheckIn>(&self.store, &checkin_stream(user_id), |event| {
            let zhihui_domain::checkin::CheckInEvent::CheckedIn(e) = event;
            if e.day == day {
                found = Some(e.clone());
            }
        })
        .await?;
        Ok(found)
    }
}

/// The streak from month bitmaps (`bits_of` answers the months read; an absent one is empty):
/// consecutive days ending today, or yesterday when today is not checked in. `None` when it
/// reaches back before the months read (the caller asks the events).
fn streak_from_bits(today: NaiveDate, bits_of: &dyn Fn(NaiveDate) -> MonthBits) -> Option<u32> {
    let oldest = previous_month(month_of(today));
    let checked = |day: NaiveDate| bits_of(month_of(day)).has(day.day());
    let mut day = if checked(today) {
        today
    } else {
        today.pred_opt()?
    };
    let mut streak = 0;
    while checked(day) {
        streak += 1;
        day = day.pred_opt()?;
        if day < oldest {
            return None;
        }
    }
    Some(streak)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn day(text: &str) -> NaiveDate {
        text.parse().unwrap()
    }

    #[test]
    fn bits_round_trip_through_redis_bytes() {
        let days: BTreeSet<NaiveDate> = ["2027-01-01", "2027-01-15", "2027-01-31", "2027-02-01"]
            .iter()
            .map(|d| day(d))
            .collect();
        let bits = MonthBits::of_days(day("2027-01-01"), &days);
        assert!(bits.complete());
        let bytes = bits.0.to_be_bytes();
        // SETBIT offset 1 is the second-highest bit of the first byte.
        assert_eq!(bytes[0] & 0b1100_0000, 0b1100_0000);
        let back = MonthBits::from_redis(&bytes[..]);
        assert_eq!(
            back.days(day("2027-01-01")),
            vec![day("2027-01-01"), day("2027-01-15"), day("2027-01-31")]
        );
        // Redis drops trailing zero bytes of a short bitmap: still read right.
        assert_eq!(
            MonthBits::from_redis(&[0b1000_0000]),
            MonthBits::default().with(0)
        );
    }

    #[test]
    fn a_streak_runs_across_the_month_end_and_stops_before_the_months_read() {
        let days: BTreeSet<NaiveDate> = (0..10)
            .map(|n| day("2027-01-26") + chrono::Duration::days(n))
            .collect();
        let bits_of = |month: NaiveDate| MonthBits::of_days(month, &days);
        assert_eq!(streak_from_bits(day("2027-02-04"), &bits_of), Some(10));
        assert_eq!(streak_from_bits(day("2027-02-05"), &bits_of), Some(10));
        assert_eq!(streak_from_bits(day("2027-02-06"), &bits_of), Some(0));
        let long: BTreeSet<NaiveDate> = (0..70)
            .map(|n| day("2026-12-01") + chrono::Duration::days(n))
            .collect();
        let bits_of = |month: NaiveDate| MonthBits::of_days(month, &long);
        assert_eq!(streak_from_bits(day("2027-02-08"), &bits_of), None);
    }

    #[test]
    fn months_parse_as_their_first_day() {
        assert_eq!(parse_month("2027-02"), Some(day("2027-02-01")));
        assert_eq!(parse_month("2027-13"), None);
        assert_eq!(parse_month("27-02"), None);
        assert_eq!(parse_month("2027-2"), None);
    }
}
