//! `works`, `work_likes`, `follows` and `work_reports` (see `migrations/V15__gallery.sql` and
//! `V19__work_reports.sql`) from the work, like, follow and report streams. A like or a follow is once per pair on its pair's own stream, so an insert that
//! finds its row (or a delete that finds none) only happens when a batch is applied again after a
//! crash before its commit; the like count moves only with a row actually inserted or deleted.
//! A run of like events in a batch is folded to each pair's last state and written as one
//! statement (one like at a time, a burst of likes on one work was applied at about 2,000 a
//! second, each a statement and an update of the work's row, seconds behind the likes).

use std::collections::HashMap;

use anyhow::Context;
use chrono::{DateTime, Utc};
use uuid::Uuid;
use zhihui_domain::DomainEvent;
use zhihui_domain::gallery::follow::FollowEvent;
use zhihui_domain::gallery::like::LikeEvent;
use zhihui_domain::gallery::report::ReportEvent;
use zhihui_domain::gallery::work::WorkEvent;

use crate::{ProjectedEvent, Tables};

/// The stream prefixes the projection reads.
pub const STREAM_PREFIXES: &[&str] = &["work-", "like-", "follow-", "report-"];

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let works = tables.name("works");
    let work_likes = tables.name("work_likes");
    let follows = tables.name("follows");
    let work_reports = tables.name("work_reports");
    let mut likes = PendingLikes::default();
    for recorded in events {
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        let version = i64::try_from(recorded.stream_version)?;
        if !recorded.stream.starts_with("like-") {
            // Likes commute with one another, not with a work's own events.
            likes.write(transaction, &works, &work_likes).await?;
        }
        if recorded.stream.starts_with("work-") {
            let event = WorkEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            match event {
                WorkEvent::Published(e) => {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {works} (work_id, creator, task_id, images, title,
                                     description, prompt_shown, status, published_at, stream_version)
                                 VALUES ($1, $2, $3, $4, $5, $6, $7, 'published', $8, $9)
                                 ON CONFLICT (work_id) DO UPDATE SET
                                     images = EXCLUDED.images, title = EXCLUDED.title,
                                     description = EXCLUDED.description,
                                     prompt_shown = EXCLUDED.prompt_shown, status = 'published',
                                     hidden_reason = NULL, published_at = EXCLUDED.published_at,
                                     stream_version = EXCLUDED.stream_version
                                 WHERE {works}.stream_version < EXCLUDED.stream_version"
                            ),
                            &[
                                &e.work_id,
                                &e.creator.as_uuid(),
                                &e.task_id,
                                &e.images,
                                &e.title.as_str(),
                                &e.description.as_ref().map(|d| d.as_str()),
                                &e.prompt_shown,
                                &e.published_at,
                                &version,
                            ],
                        )
                        .await
                        .context("recording a publication")?;
                }
                WorkEvent::Unpublished(e) => {
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {works} SET status = 'unpublished', stream_version = $2
                                  WHERE work_id = $1 AND stream_version < $2"
                            ),
                            &[&e.work_id, &version],
                        )
                        .await
                        .context("recording an unpublication")?;
                }
                WorkEvent::Hidden(e) => {
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {works} SET status = 'hidden', hidden_reason = $3,
                                        stream_version = $2
                                  WHERE work_id = $1 AND stream_version < $2"
                            ),
                            &[&e.work_id, &version, &e.reason.as_str()],
                        )
                        .await
                        .context("recording a hidden work")?;
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {work_reports}
                                    SET status = 'upheld', resolved_by = $2, resolved_at = $3
                                  WHERE work_id = $1 AND status = 'open'"
                            ),
                            &[&e.work_id, &e.admin.as_uuid(), &e.hidden_at],
                        )
                        .await
                        .context("upholding a hidden work's reports")?;
                }
            }
        } else if recorded.stream.starts_with("like-") {
            let event = LikeEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            match event {
                LikeEvent::Liked(e) => {
                    likes.record(e.work_id, e.user_id.as_uuid(), Some(e.liked_at))
                }
                LikeEvent::Unliked(e) => likes.record(e.work_id, e.user_id.as_uuid(), None),
            }
            continue;
        } else if recorded.stream.starts_with("report-") {
            let event = ReportEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            match event {
                // A report that reaches a work hidden already (decided while it was visible)
                // is upheld by that hiding.
                ReportEvent::Reported(e) => {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {work_reports} AS r
                                     (work_id, reporter, reason, note, reported_at, status,
                                      resolved_at)
                                 SELECT $1::uuid, $2::uuid, $3::text, $4::text, $5::timestamptz,
                                        CASE WHEN w.status = 'hidden' THEN 'upheld' ELSE 'open' END,
                                        CASE WHEN w.status = 'hidden' THEN $5::timestamptz END
                                   FROM (SELECT 1) AS one
                                   LEFT JOIN {works} w ON w.work_id = $1
                                 ON CONFLICT (work_id, reporter) DO NOTHING"
                            ),
                            &[
                                &e.work_id,
                                &e.reporter.as_uuid(),
                                &e.reason.as_str(),
                                &e.note.as_ref().map(|note| note.as_str()),
                                &e.reported_at,
                            ],
                        )
                        .await
                        .context("recording a report")?;
                }
                // Told on the report's own stream, a dismissal is the report's last word, also
                // when a hiding of the work reached the read model first (two admins at once).
                ReportEvent::Dismissed(e) => {
                    transaction
                        .execute(
                            &format!(
                                "UPDATE {work_reports}
                                    SET status = 'dismissed', resolved_by = $3, resolved_at = $4
                                  WHERE work_id = $1 AND reporter = $2
                                    AND status <> 'dismissed'"
                            ),
                            &[
                                &e.work_id,
                                &e.reporter.as_uuid(),
                                &e.admin.as_uuid(),
                                &e.dismissed_at,
                            ],
                        )
                        .await
                        .context("recording a dismissed report")?;
                }
            }
        } else if recorded.stream.starts_with("follow-") {
            let event = FollowEvent::from_stored(
                &recorded.event_type,
                recorded.schema_version,
                &recorded.payload,
            )
            .with_context(context)?;
            match event {
                FollowEvent::Followed(e) => {
                    transaction
                        .execute(
                            &format!(
                                "INSERT INTO {follows} (follower, creator, followed_at)
                                 VALUES ($1, $2, $3) ON CONFLICT DO NOTHING"
                            ),
                            &[&e.follower.as_uuid(), &e.creator.as_uuid(), &e.followed_at],
                        )
                        .await
                        .context("recording a follow")?;
                }
                FollowEvent::Unfollowed(e) => {
                    transaction
                        .execute(
                            &format!("DELETE FROM {follows} WHERE follower = $1 AND creator = $2"),
                            &[&e.follower.as_uuid(), &e.creator.as_uuid()],
                        )
                        .await
                        .context("recording an unfollow")?;
                }
            }
        }
    }
    likes.write(transaction, &works, &work_likes).await
}

/// A run of like events, folded to each pair's last state (liked at, or not liked): a burst of
/// likes is one statement instead of one per like, and the hot work's row is updated once.
#[derive(Default)]
struct PendingLikes {
    /// (work, user) -> liked at (None: unliked).
    last: HashMap<(Uuid, Uuid), Option<DateTime<Utc>>>,
}

impl PendingLikes {
    fn record(&mut self, work: Uuid, user: Uuid, liked_at: Option<DateTime<Utc>>) {
        self.last.insert((work, user), liked_at);
    }

    /// Write the run: a pair liked in the end gets its row (its time updated when it was there
    /// already: an unlike and a like again), a pair not liked in the end loses it; each work's
    /// count moves by the rows that were not there before and are now, less those that were and
    /// are not. Every part of one statement sees the rows as they were before it.
    async fn write(
        &mut self,
        transaction: &tokio_postgres::Transaction<'_>,
        works: &str,
        work_likes: &str,
    ) -> anyhow::Result<()> {
        if self.last.is_empty() {
            return Ok(());
        }
        let mut work_ids = Vec::with_capacity(self.last.len());
        let mut user_ids = Vec::with_capacity(self.last.len());
        let mut times = Vec::with_capacity(self.last.len());
        for ((work, user), liked_at) in self.last.drain() {
            work_ids.push(work);
            user_ids.push(user);
            times.push(liked_at);
        }
        transaction
            .execute(
                &format!(
                    "WITH f AS (
                         SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::timestamptz[])
                                    AS f(work_id, user_id, liked_at)),
                     before AS (
                         SELECT l.work_id, l.user_id FROM {work_likes} l
                           JOIN f ON f.work_id = l.work_id AND f.user_id = l.user_id),
                     removed AS (
                         DELETE FROM {work_likes} l USING f
                          WHERE l.work_id = f.work_id AND l.user_id = f.user_id
                            AND f.liked_at IS NULL),
                     added AS (
                         INSERT INTO {work_likes} (work_id, user_id, liked_at)
                         SELECT work_id, user_id, liked_at FROM f WHERE liked_at IS NOT NULL
                         ORDER BY work_id, user_id
                         ON CONFLICT (work_id, user_id) DO UPDATE SET liked_at = EXCLUDED.liked_at),
                     moved AS (
                         SELECT f.work_id,
                                sum(CASE WHEN f.liked_at IS NOT NULL AND b.user_id IS NULL THEN 1
                                         WHEN f.liked_at IS NULL AND b.user_id IS NOT NULL THEN -1
                                         ELSE 0 END) AS by
                           FROM f LEFT JOIN before b
                                ON b.work_id = f.work_id AND b.user_id = f.user_id
                          GROUP BY f.work_id)
                     UPDATE {works} w SET like_count = w.like_count + m.by
                       FROM moved m WHERE w.work_id = m.work_id AND m.by <> 0"
                ),
                &[&work_ids, &user_ids, &times],
            )
            .await
            .context("recording likes")?;
        Ok(())
    }
}
