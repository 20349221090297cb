//! Daily active users: every authenticated request counts its user once per calendar day in
//! that day's HyperLogLog (PFADD). A process remembers whom it counted today, so a user costs at
//! most one Redis call per day per process; the memory is bounded
//! (`stats.active_users_remembered_max`: beyond it the process forgets and counts again, which
//! PFADD makes harmless). A count is an estimate, never a fact anything else depends on.
//!
//! One Redis HyperLogLog has a standard error of 0.81 %: at a million users a day's count is off
//! by over 1 % one day in five (BENCHMARKS.md). So a day is `stats.active_users_shards` keys
//! (`dau:<YYYY-MM-DD>:<shard>`), each user always in the same shard (by its id): the shards
//! count disjoint sets, so the day's count is their sum and its error shrinks by the square root
//! of the shards (16: about 0.2 %, for 16 x 12 KB a day at most). The distinct users over a range
//! are, shard by shard, the PFCOUNT of that shard's keys over the days (their union), summed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use zhihui_domain::rule::{Broken, Rule};

use anyhow::Context;
use chrono::NaiveDate;
use uuid::Uuid;
use zhihui_domain::checkin::day_of;

use crate::platform::clock::Clock;
use crate::platform::configuration::StatsSettings;
use crate::platform::redis_store::RedisStore;

/// Days one report may span (PFCOUNT merges one key per day).
pub const REPORT_DAYS_MAX: i64 = 400;

/// Check a report's range: `from` not after `to`, at most [`REPORT_DAYS_MAX`] days. The error
/// names the field and the rule.
pub fn check_range(from: NaiveDate, to: NaiveDate) -> Result<(), (&'static str, Broken)> {
    if from > to {
        return Err((
            "from",
            Broken::new(Rule::NotAfter)
                .with("other", "to")
                .with("value", to),
        ));
    }
    if (to - from).num_days() >= REPORT_DAYS_MAX {
        return Err((
            "from",
            Broken::new(Rule::SpanAtMost).with("days", REPORT_DAYS_MAX),
        ));
    }
    Ok(())
}

#[derive(Debug, Default)]
struct Remembered {
    day: Option<NaiveDate>,
    users: HashSet<Uuid>,
}

#[derive(Debug, Clone)]
pub struct ActiveUsers {
    redis: RedisStore,
    clock: Clock,
    settings: StatsSettings,
    day_utc_offset_minutes: i32,
    remembered: Arc<Mutex<Remembered>>,
}

/// Each day's count, and the distinct users over the whole range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveUsersReport {
    pub days: Vec<(NaiveDate, u64)>,
    pub distinct: u64,
}

impl ActiveUsers {
    pub fn new(
        redis: RedisStore,
        clock: Clock,
        settings: StatsSettings,
        day_utc_offset_minutes: i32,
    ) -> ActiveUsers {
        ActiveUsers {
            redis,
            clock,
            settings,
            day_utc_offset_minutes,
            remembered: Arc::default(),
        }
    }

    /// A shard's days share a tag (a report counts the union of one shard's days with one
    /// PFCOUNT); the shards spread over a cluster's nodes.
    fn key(&self, day: NaiveDate, shard: u32) -> String {
        self.redis.tagged(&format!("dau:{shard}"), &day.to_string())
    }

    fn shards(&self) -> u32 {
        self.settings.active_users_shards.max(1)
    }

    /// A user's shard: the low bits of its id (random in UUIDv4 and v7 alike).
    fn shard_of(&self, user_id: Uuid) -> u32 {
        u32::try_from(user_id.as_u128() % u128::from(self.shards())).unwrap_or(0)
    }

    /// The keys of one day, by shard.
    pub fn day_keys(&self, day: NaiveDate) -> Vec<String> {
        (0..self.shards())
            .map(|shard| self.key(day, shard))
            .collect()
    }

    /// Count `user_id` as active today; a Redis failure is logged and forgotten (the user is
    /// counted on a later request).
    pub async fn seen(&self, user_id: Uuid) {
        if !self.settings.active_users_enabled {
            return;
        }
        let today = day_of(self.clock.now(), self.day_utc_offset_minutes);
        let first_today = {
            let mut remembered = self
                .remembered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if remembered.day != Some(today) {
                remembered.day = Some(today);
                remembered.users.clear();
            }
            if remembered.users.len() >= self.settings.active_users_remembered_max {
                remembered.users.clear();
            }
            remembered.users.insert(user_id)
        };
        if !first_today {
            return;
        }
        if let Err(error) = self.record(today, &[user_id]).await {
            tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "active user not counted");
            let mut remembered = self
                .remembered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            remembered.users.remove(&user_id);
        }
    }

    /// Add users to a day's count (one PFADD per shard they fall in, the shards at once; a key
    /// lives the retention after its last write).
    pub async fn record(&self, day: NaiveDate, users: &[Uuid]) -> anyhow::Result<()> {
        if users.is_empty() {
            return Ok(());
        }
        let mut by_shard: Vec<Vec<&[u8; 16]>> = vec![Vec::new(); self.shards() as usize];
        for user in users {
            by_shard[self.shard_of(*user) as usize].push(user.as_bytes());
        }
        let retention = i64::from(self.settings.active_users_retention_days) * 86_400;
        let connection = self.redis.connection().await?;
        // One pipeline per shard (a pipeline stays in one slot of a cluster), sent together.
        let writes = (0..)
            .zip(&by_shard)
            .filter(|(_, members)| !members.is_empty())
            .map(|(shard, members)| {
                let key = self.key(day, shard);
                let mut pipe = redis::pipe();
                pipe.cmd("PFADD").arg(&key).arg(members).ignore();
                pipe.cmd("EXPIRE").arg(&key).arg(retention).ignore();
                let mut connection = connection.clone();
                async move { pipe.query_async::<()>(&mut connection).await }
            });
        futures::future::try_join_all(writes)
            .await
            .context("counting active users")?;
        Ok(())
    }

    /// Each day's count from `from` to `to` (inclusive) and the distinct users over them all.
    pub async fn report(
        &self,
        from: NaiveDate,
        to: NaiveDate,
    ) -> anyhow::Result<ActiveUsersReport> {
        let days: Vec<NaiveDate> = from.iter_days().take_while(|day| *day <= to).collect();
        let connection = self.redis.connection().await?;
        // Per shard, one pipeline: each day's count, then the union of its days (PFCOUNT of
        // several keys counts their union without changing them).
        let per_shard = (0..self.shards()).map(|shard| {
            let mut pipe = redis::pipe();
            for day in &days {
                pipe.cmd("PFCOUNT").arg(self.key(*day, shard));
            }
            let keys: Vec<String> = days.iter().map(|day| self.key(*day, shard)).collect();
            pipe.cmd("PFCOUNT").arg(keys);
            let mut connection = connection.clone();
            async move { pipe.query_async::<Vec<u64>>(&mut connection).await }
        });
        let counts = futures::future::try_join_all(per_shard)
            .await
            .context("counting active users")?;
        let per_day = days
            .iter()
            .enumerate()
            .map(|(index, day)| (*day, counts.iter().map(|shard| shard[index]).sum()))
            .collect();
        Ok(ActiveUsersReport {
            days: per_day,
            distinct: counts.iter().map(|shard| shard[days.len()]).sum(),
        })
    }

    /// Today, on the platform's calendar.
    pub fn today(&self) -> NaiveDate {
        day_of(self.clock.now(), self.day_utc_offset_minutes)
    }
}
