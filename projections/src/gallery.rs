//! `works`, `work_likes` and `follows` (see `migrations/V15__gallery.sql`) from the work, like and
//! follow streams. A like or a follow is once per pair on its pair's own stream, so an insert that
//! finds its row (or a delete that finds none) only happens when a batch is applied again after a
//! crash before its commit; the like count moves only with a row actually inserted or deleted.

use anyhow::Context;
use zhihui_domain::DomainEvent;
use zhihui_domain::gallery::follow::FollowEvent;
use zhihui_domain::gallery::like::LikeEvent;
use zhihui_domain::gallery::work::WorkEvent;

use crate::{ProjectedEvent, Tables};

/// The stream prefixes the projection reads.
pub const STREAM_PREFIXES: &[&str] = &["work-", "like-", "follow-"];

pub async fn apply(
    transaction: &tokio_postgres::Transaction<'_>,
    tables: &Tables,
    events: &[ProjectedEvent],
) -> anyhow::Result<()> {
    let works = tables.name("works");
    let likes = tables.name("work_likes");
    let follows = tables.name("follows");
    for recorded in events {
        let context = || format!("event {} of {}", recorded.id, recorded.stream);
        let version = i64::try_from(recorded.stream_version)?;
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
                    transaction
                        .execute(
                            &format!(
                                "WITH added AS (
                                     INSERT INTO {likes} (work_id, user_id, liked_at)
                                     VALUES ($1, $2, $3) ON CONFLICT DO NOTHING RETURNING work_id)
                                 UPDATE {works} SET like_count = like_count + 1
                                  WHERE work_id IN (SELECT work_id FROM added)"
                            ),
                            &[&e.work_id, &e.user_id.as_uuid(), &e.liked_at],
                        )
                        .await
                        .context("recording a like")?;
                }
                LikeEvent::Unliked(e) => {
                    transaction
                        .execute(
                            &format!(
                                "WITH removed AS (
                                     DELETE FROM {likes} WHERE work_id = $1 AND user_id = $2
                                     RETURNING work_id)
                                 UPDATE {works} SET like_count = like_count - 1
                                  WHERE work_id IN (SELECT work_id FROM removed)"
                            ),
                            &[&e.work_id, &e.user_id.as_uuid()],
                        )
                        .await
                        .context("recording an unlike")?;
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
    Ok(())
}
