//! The gallery worker (one leader, `process:gallery`): follows the work, like and follow streams
//! in the log's order and makes Redis agree with them, pushes each new work into its creator's
//! followers' inboxes, and recomputes the hot ranking as works age.
//!
//! Its progress is kept in Redis itself (`{gallery}:through`): what it covers is exactly what
//! Redis holds. A flushed Redis (or one that lost the key in a failover) has no progress, so the
//! worker starts again from the log's beginning and writes every set back; `zhihui gallery
//! rebuild` does the same on demand. Every write is idempotent and a pair's is applied only over
//! an older version, so applying an event twice, or after the request that appended it already
//! did, changes nothing.
//!
//! A Redis can also lose only its last writes and look complete: a replica promoted in its
//! master's place has what it had received, a restarted Redis what its AOF had fsynced, and in a
//! cluster `through` may live on a master that lost nothing while a like set lost a member on
//! another. The worker keeps the masters' replication ids beside `through` (`{gallery}:masters`)
//! and compares them before it applies; other ids mean such an event, and it moves `through`
//! back to where it stood `gallery.redis_loss_window_ms` earlier (its own trail of where it
//! stood; from the log's beginning when the trail is shorter), so the lost writes are made again.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use redis::AsyncCommands;
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::gallery::block::BlockEvent;
use zhihui_domain::gallery::follow::FollowEvent;
use zhihui_domain::gallery::like::LikeEvent;
use zhihui_domain::gallery::work::{Work, WorkEvent, work_stream};
use zhihui_domain::user::UserId;

use super::{GalleryService, apply_follow_pair, apply_pair, apply_work_lists, hot_score};
use crate::platform::configuration::ProjectionSettings;
use crate::platform::event_store::{EventFilter, EventStore, Position, RecordedEvent};
use crate::platform::projector::BatchOutcome;

/// Name of the leader lock.
pub const GALLERY_WORKER: &str = "process:gallery";

/// Followers pushed to per pipeline.
const PUSH_BATCH: usize = 500;

#[derive(Debug, Clone)]
pub struct GalleryWorker {
    gallery: GalleryService,
    settings: ProjectionSettings,
    trail: Arc<Mutex<Trail>>,
}

/// A trail sample at most this often.
const TRAIL_EVERY: Duration = Duration::from_secs(1);

/// Where this worker stood lately (when, `through`), one sample a second at most, back to the
/// newest sample older than the window: where to go back to after Redis may have lost writes.
#[derive(Debug, Default)]
struct Trail {
    samples: VecDeque<(Instant, Option<Position>)>,
}

impl Trail {
    fn record(&mut self, at: Instant, through: Option<Position>, window: Duration) {
        if self
            .samples
            .back()
            .is_some_and(|(last, _)| at.saturating_duration_since(*last) < TRAIL_EVERY)
        {
            return;
        }
        self.samples.push_back((at, through));
        while self
            .samples
            .get(1)
            .is_some_and(|(second, _)| at.saturating_duration_since(*second) >= window)
        {
            self.samples.pop_front();
        }
    }

    /// Where the worker stood at least `window` before `now`; `None` (the log's beginning) when
    /// the trail does not reach back that far.
    fn before(&self, now: Instant, window: Duration) -> Option<Position> {
        self.samples
            .iter()
            .rev()
            .find(|(at, _)| now.saturating_duration_since(*at) >= window)
            .and_then(|(_, through)| *through)
    }
}

fn filter() -> EventFilter {
    EventFilter::StreamPrefixes(vec![
        "work-".into(),
        "like-".into(),
        "follow-".into(),
        "block-".into(),
    ])
}

fn parse_position(text: &str) -> Option<Position> {
    let (commit, prepare) = text.split_once('/')?;
    Some(Position {
        commit: commit.parse().ok()?,
        prepare: prepare.parse().ok()?,
    })
}

impl GalleryWorker {
    pub fn new(gallery: GalleryService, settings: ProjectionSettings) -> GalleryWorker {
        GalleryWorker {
            gallery,
            settings,
            trail: Arc::default(),
        }
    }

    fn loss_window(&self) -> Duration {
        Duration::from_millis(self.gallery.settings().redis_loss_window_ms)
    }

    /// Compare the masters' replication ids with those `through` was last checked against;
    /// other ids (Redis may have lost its last writes) move `through` back by the loss window.
    /// Whether it moved.
    pub async fn check_masters(&self) -> anyhow::Result<bool> {
        let now_on = self.gallery.redis().masters_identity().await?;
        let mut connection = self.gallery.redis().connection().await?;
        let (was_on, through): (Option<String>, Option<String>) = redis::pipe()
            .get(self.gallery.keys().masters())
            .get(self.gallery.keys().through())
            .query_async(&mut connection)
            .await
            .context("reading the gallery's progress")?;
        if was_on.as_deref() == Some(now_on.as_str()) {
            return Ok(false);
        }
        let through = through.as_deref().and_then(parse_position);
        let back_to = match was_on {
            // Never checked (a new or flushed Redis: `through` is gone too, or an older zhihui).
            None => through,
            Some(_) => {
                let trail = self
                    .trail
                    .lock()
                    .map_err(|_| anyhow::anyhow!("the gallery worker's trail is poisoned"))?;
                trail
                    .before(Instant::now(), self.loss_window())
                    .min(through)
            }
        };
        // `through` first: stopped in between, the next check moves it back again.
        let mut pipe = redis::pipe();
        match back_to {
            Some(position) => pipe.set(self.gallery.keys().through(), position.to_string()),
            None => pipe.del(self.gallery.keys().through()),
        };
        pipe.ignore()
            .set(self.gallery.keys().masters(), &now_on)
            .ignore()
            .query_async::<()>(&mut connection)
            .await
            .context("moving the gallery's progress back")?;
        let moved = back_to != through;
        if moved {
            tracing::warn!(
                from = ?through,
                to = ?back_to,
                "Redis restarted or failed over and may lack its last writes: the gallery worker applies the log again"
            );
        }
        Ok(moved)
    }

    /// How far Redis holds the log (`None`: nothing, e.g. after a flush).
    pub async fn through(&self) -> anyhow::Result<Option<Position>> {
        let mut connection = self.gallery.redis().connection().await?;
        let text: Option<String> = connection
            .get(self.gallery.keys().through())
            .await
            .context("reading the gallery's progress")?;
        Ok(text.as_deref().and_then(parse_position))
    }

    async fn store_through(&self, position: Position) -> anyhow::Result<()> {
        let mut connection = self.gallery.redis().connection().await?;
        let _: () = connection
            .set(self.gallery.keys().through(), position.to_string())
            .await
            .context("storing the gallery's progress")?;
        if let Ok(mut trail) = self.trail.lock() {
            trail.record(Instant::now(), Some(position), self.loss_window());
        }
        Ok(())
    }

    /// Start again from the log's beginning (the next batch writes everything back).
    pub async fn reset(&self) -> anyhow::Result<()> {
        let mut connection = self.gallery.redis().connection().await?;
        let _: i64 = connection
            .del(self.gallery.keys().through())
            .await
            .context("resetting the gallery's progress")?;
        Ok(())
    }

    /// One step: apply the next page of the log after the progress Redis holds.
    pub async fn apply_batch(&self) -> anyhow::Result<BatchOutcome> {
        self.check_masters().await?;
        let through = self.through().await?;
        let slice = self
            .gallery
            .store()
            .read_all(through, self.settings.batch_size, &filter())
            .await
            .context("reading the log")?;
        let Some(scanned_to) = slice.scanned_to.filter(|to| Some(*to) != through) else {
            return Ok(BatchOutcome::CaughtUp);
        };
        self.apply_all(&slice.events).await?;
        self.store_through(scanned_to).await?;
        Ok(BatchOutcome::Applied {
            events: slice.events.len(),
        })
    }

    /// Steps until caught up; returns the events applied.
    pub async fn catch_up(&self) -> anyhow::Result<u64> {
        let mut applied = 0u64;
        while let BatchOutcome::Applied { events } = self.apply_batch().await? {
            applied += events as u64;
        }
        Ok(applied)
    }

    /// Write Redis back from the whole log, then rank again: what `zhihui gallery rebuild`
    /// runs.
    pub async fn rebuild(&self) -> anyhow::Result<u64> {
        self.reset().await?;
        let applied = self.catch_up().await?;
        self.recompute_hot().await?;
        Ok(applied)
    }

    /// `events` in the log's order, except that likes are applied a run at a time, all at once
    /// (the connection pipelines them): each is gated by its pair's version, so their order
    /// among themselves does not matter. A run ends before any other event.
    async fn apply_all(&self, events: &[RecordedEvent]) -> anyhow::Result<()> {
        let mut likes: Vec<&RecordedEvent> = Vec::new();
        for event in events {
            if event.stream.starts_with("like-") {
                likes.push(event);
                continue;
            }
            self.apply_likes(&likes).await?;
            likes.clear();
            self.apply(event).await?;
        }
        self.apply_likes(&likes).await
    }

    /// Like events into their works' like sets, at once, `PUSH_BATCH` at a time.
    async fn apply_likes(&self, likes: &[&RecordedEvent]) -> anyhow::Result<()> {
        let keys = self.gallery.keys();
        let connection = self.gallery.redis().connection().await?;
        for chunk in likes.chunks(PUSH_BATCH) {
            let mut applies = Vec::with_capacity(chunk.len());
            for recorded in chunk {
                let event = LikeEvent::from_stored(
                    &recorded.event_type,
                    recorded.schema_version,
                    &recorded.payload,
                )
                .with_context(|| format!("event {} of {}", recorded.id, recorded.stream))?;
                let (work_id, user, since) = match &event {
                    LikeEvent::Liked(e) => (e.work_id, e.user_id, Some(e.liked_at)),
                    LikeEvent::Unliked(e) => (e.work_id, e.user_id, None),
                };
                let mut connection = connection.clone();
                let version = recorded.stream_version;
                applies.push(async move {
                    apply_pair(
                        &mut connection,
                        &keys.likes(work_id),
                        &keys.like_versions(work_id),
                        &user.to_string(),
                        Some(version),
                        since,
                    )
                    .await
                });
            }
            futures::future::try_join_all(applies).await?;
        }
        Ok(())
    }

    /// One event other than a like (`apply_likes` applies those).
    async fn apply(&self, recorded: &RecordedEvent) -> anyhow::Result<()> {
        let gallery = &self.gallery;
        let keys = gallery.keys();
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        let mut connection = gallery.redis().connection().await?;
        if recorded.stream.starts_with("work-") {
            let event = WorkEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            let work_id = match &event {
                WorkEvent::Published(e) => e.work_id,
                WorkEvent::Unpublished(e) => e.work_id,
                WorkEvent::Hidden(e) => e.work_id,
            };
            // The work as it stands now: a list never shows what a later event took down.
            let now =
                crate::platform::command::load::<Work>(gallery.store(), &work_stream(work_id))
                    .await?;
            if let Some(last) = &now.state.last {
                apply_work_lists(
                    keys,
                    &mut connection,
                    work_id,
                    last.creator,
                    now.state.status,
                    last.published_at,
                    gallery.settings().hot_max,
                )
                .await?;
                gallery.forget_card(work_id).await;
                if let WorkEvent::Published(published) = &event
                    && now.state.status.is_visible()
                {
                    self.push(published.creator, work_id, published.published_at)
                        .await?;
                }
            }
        } else if recorded.stream.starts_with("follow-") {
            let event = FollowEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            let (follower, creator, since) = match &event {
                FollowEvent::Followed(e) => (e.follower, e.creator, Some(e.followed_at)),
                FollowEvent::Unfollowed(e) => (e.follower, e.creator, None),
            };
            apply_follow_pair(
                keys,
                &mut connection,
                follower,
                creator,
                Some(recorded.stream_version),
                since,
                gallery.settings().push_followers_max,
            )
            .await?;
        } else if recorded.stream.starts_with("block-") {
            let event = BlockEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            let (user, creator, since) = match &event {
                BlockEvent::Blocked(e) => (e.user, e.creator, Some(e.blocked_at)),
                BlockEvent::Unblocked(e) => (e.user, e.creator, None),
            };
            apply_pair(
                &mut connection,
                &keys.blocked(user),
                &keys.blocked_versions(user),
                &creator.to_string(),
                Some(recorded.stream_version),
                since,
            )
            .await?;
        }
        Ok(())
    }

    /// A new work into each follower's inbox, unless its creator has too many followers (then
    /// their followers pull it when they read their feed). Inboxes not read lately are skipped.
    /// Returns the inboxes it went into.
    pub async fn push(
        &self,
        creator: UserId,
        work_id: Uuid,
        published_at: DateTime<Utc>,
    ) -> anyhow::Result<u64> {
        let gallery = &self.gallery;
        let keys = gallery.keys();
        let mut connection = gallery.redis().connection().await?;
        let followers: u64 = connection
            .zcard(keys.followers(creator))
            .await
            .context("counting followers")?;
        if followers > u64::from(gallery.settings().push_followers_max) {
            return Ok(0);
        }
        let followers: Vec<String> = connection
            .zrange(keys.followers(creator), 0, -1)
            .await
            .context("reading followers")?;
        let mut pushed = 0u64;
        let inbox_max = gallery.settings().inbox_max as isize;
        for chunk in followers.chunks(PUSH_BATCH) {
            let chunk: Vec<UserId> = chunk
                .iter()
                .filter_map(|follower| Uuid::parse_str(follower).ok())
                .map(UserId::from_uuid)
                .collect();
            if chunk.is_empty() {
                continue;
            }
            // Which inboxes are live, then the work into those, each step sent for the whole
            // chunk at once (every follower's keys are on their own node). An inbox that expires
            // in between gets the work without its marker, and its owner's next read rebuilds
            // it anyway.
            let live: Vec<bool> = super::each(
                &connection,
                chunk.iter().map(|follower| {
                    let mut command = redis::cmd("EXISTS");
                    command.arg(keys.inbox_live(*follower));
                    command
                }),
            )
            .await
            .context("finding the live inboxes")?;
            let live: Vec<UserId> = chunk
                .iter()
                .zip(&live)
                .filter(|(_, live)| **live)
                .map(|(follower, _)| *follower)
                .collect();
            let pushes = live.iter().flat_map(|follower| {
                let inbox = keys.inbox(*follower);
                let mut add = redis::cmd("ZADD");
                add.arg(&inbox)
                    .arg(published_at.timestamp_millis())
                    .arg(work_id.to_string());
                let mut bound = redis::cmd("ZREMRANGEBYRANK");
                bound.arg(&inbox).arg(0).arg(-(inbox_max + 1));
                [add, bound]
            });
            let _: Vec<i64> = super::each(&connection, pushes)
                .await
                .context("pushing a work into inboxes")?;
            pushed += live.len() as u64;
        }
        metrics::counter!("zhihui_gallery_inbox_pushes_total").increment(pushed);
        Ok(pushed)
    }

    /// The hot ranking again from the read model: every visible work of the window, scored
    /// with its likes and its age now, the best `hot_max` kept, and the works the read model
    /// has not reached yet kept where they were.
    pub async fn recompute_hot(&self) -> anyhow::Result<usize> {
        let gallery = &self.gallery;
        let keys = gallery.keys();
        let now = gallery.clock().now();
        let since = now - chrono::Duration::days(i64::from(gallery.settings().hot_window_days));
        let client = gallery.pool().get().await.context("getting a connection")?;
        let rows = client
            .query(
                "SELECT work_id, like_count, published_at FROM works
                  WHERE status = 'published' AND published_at > $1",
                &[&since],
            )
            .await
            .context("reading the works to rank")?;
        // Works published after the newest the read model has (less a margin for clocks) may
        // not have reached it yet: the replace keeps those the ranking already has.
        let unread_since = rows
            .iter()
            .map(|row| row.get::<_, DateTime<Utc>>(2))
            .max()
            .map_or(since, |newest| newest - chrono::Duration::minutes(5));
        let mut scored: Vec<(String, f64)> = rows
            .iter()
            .map(|row| {
                let work_id: Uuid = row.get(0);
                let likes: i64 = row.get(1);
                let published_at: DateTime<Utc> = row.get(2);
                (
                    work_id.to_string(),
                    hot_score(likes.max(0) as u64, published_at, now),
                )
            })
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1));
        scored.truncate(gallery.settings().hot_max as usize);
        let mut connection = gallery.redis().connection().await?;
        let mut invocation = super::keys::HOT_REPLACE.key(keys.hot());
        invocation
            .key(keys.hot_next())
            .key(keys.newest())
            .arg(unread_since.timestamp_millis());
        for (member, score) in &scored {
            invocation.arg(*score).arg(member);
        }
        let _ranked: i64 = invocation
            .invoke_async(&mut connection)
            .await
            .context("replacing the hot ranking")?;
        Ok(scored.len())
    }

    /// Run forever: wait to be the leader, then follow the log and rank on the clock.
    pub async fn run(self) -> anyhow::Result<()> {
        let takeover_check = Duration::from_millis(self.settings.takeover_check_ms);
        loop {
            let lock = match crate::platform::leader::try_lead(self.gallery.pool(), GALLERY_WORKER)
                .await
            {
                Ok(Some(lock)) => lock,
                Ok(None) => {
                    tokio::time::sleep(takeover_check).await;
                    continue;
                }
                Err(error) => {
                    tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "cannot reach PostgreSQL to lead the gallery worker");
                    tokio::time::sleep(takeover_check).await;
                    continue;
                }
            };
            tracing::info!("leading the gallery worker");
            if let Err(error) = self.lead(&lock).await {
                tracing::warn!(error = %crate::platform::telemetry::error_chain(&error), "gallery worker restarts");
                tokio::time::sleep(takeover_check).await;
            }
            crate::platform::leader::resign(lock);
        }
    }

    async fn lead(&self, lock: &crate::platform::leader::LeaderLock) -> anyhow::Result<()> {
        let takeover_check = Duration::from_millis(self.settings.takeover_check_ms);
        let recompute_every = Duration::from_millis(self.gallery.settings().hot_recompute_ms);
        self.check_masters().await?;
        let mut through = self.through().await?;
        if let Ok(mut trail) = self.trail.lock() {
            trail.record(Instant::now(), through, self.loss_window());
        }
        let mut subscription = self.gallery.store().subscribe_all(through, filter());
        let mut last_ranked = tokio::time::Instant::now();
        let mut last_checked = Instant::now();
        loop {
            let batch = tokio::time::timeout(
                takeover_check,
                crate::platform::leader::next_batch(
                    &mut subscription,
                    lock,
                    takeover_check,
                    self.settings.batch_size,
                ),
            )
            .await;
            // Redis may have lost its last writes: the check moves `through` back.
            if last_checked.elapsed() >= TRAIL_EVERY {
                self.check_masters().await?;
                last_checked = Instant::now();
            }
            // Redis lost its copy (a flush, a failover that lost the key, the check above):
            // start again.
            let stored = self.through().await?;
            if stored != through {
                tracing::warn!(
                    ?stored,
                    ?through,
                    "the gallery's progress in Redis moved under the worker; following the log again from there"
                );
                return Ok(());
            }
            if let Ok(batch) = batch {
                let batch = batch?;
                self.apply_all(&batch.events).await?;
                if let Some(scanned_to) = batch.scanned_to.filter(|to| Some(*to) > through) {
                    self.store_through(scanned_to).await?;
                    through = Some(scanned_to);
                }
            }
            if last_ranked.elapsed() >= recompute_every {
                self.recompute_hot().await?;
                last_ranked = tokio::time::Instant::now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(commit: u64) -> Option<Position> {
        Some(Position { commit, prepare: 1 })
    }

    #[test]
    fn the_trail_goes_back_a_whole_window_and_to_the_beginning_when_it_is_shorter() {
        let window = Duration::from_secs(10);
        let start = Instant::now();
        let mut trail = Trail::default();
        trail.record(start, at(1), window);
        // Within a second of the last sample: not kept.
        trail.record(start + Duration::from_millis(500), at(2), window);
        for second in 1..=30 {
            trail.record(start + Duration::from_secs(second), at(10 * second), window);
        }
        let now = start + Duration::from_secs(30);
        // Ten seconds before the 30th second the worker stood at the 20th second's position.
        assert_eq!(trail.before(now, window), at(200));
        assert_eq!(
            trail.before(now + Duration::from_millis(400), window),
            at(200)
        );
        // Older samples than the newest one outside the window are dropped.
        assert_eq!(trail.samples.len(), 11);
        assert_eq!(trail.samples.front().map(|(_, p)| *p), Some(at(200)));
        // A window longer than the trail: the log's beginning.
        assert_eq!(trail.before(now, Duration::from_secs(31)), None);
        assert_eq!(Trail::default().before(now, window), None);
    }
}
